#!/usr/bin/env python3
"""Generate the quickstart assets shipped in examples/, reproducibly.

    python scripts/make_quickstart_assets.py            # (re)write the assets
    python scripts/make_quickstart_assets.py --check    # regenerate in a temp dir, compare

Writes:
  examples/data/stories.jsonl    {"text": ...} short children's stories from a seeded grammar
  examples/data/stories_eval.jsonl  held-out stories for evaluation: the same grammar, its own
                                 seed, none that also occurs in the training stories
  examples/chat/data.jsonl       {"messages": [...]} conversations about the same story world
                                 (who is who, where they live, little sums, short stories)
  examples/tokenizer/            byte-level BPE (tokenizers) trained on both, saved as a Hugging
                                 Face tokenizer directory: <s> </s> <pad>, ChatML chat template
  examples/tiny-llama/config.json a small Llama config whose vocab_size matches the tokenizer

Everything is a pure function of the seeds below: the text comes from `random.Random`, and the
BPE trainer is deterministic for a given input and `tokenizers` version. The story world is
consistent (Pip is always a rabbit from the Green Forest who loves carrots and whose best
friend is Rosie), so a model fine-tuned on the chat data can answer questions about it.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

STORY_SEED = 1234
EVAL_STORY_SEED = 4321
CHAT_SEED = 5678
N_STORIES = 3600
N_EVAL_STORIES = 100
N_CHATS = 1200
VOCAB_SIZE = 2048

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
# ChatML, with the BOS the model saw at the start of every pretraining document.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a friendly assistant who knows every story in the Green Valley.",
    "You are a kind helper for children. Answer in short, simple sentences.",
]


# =========================================================================== the story world
@dataclass(frozen=True)
class Character:
    name: str
    kind: str  # "rabbit", "girl", ...
    he: str  # subject pronoun
    home: str  # "the Green Forest"
    likes: str  # plural noun or mass noun: "carrots", "honey"
    color: str  # favourite colour
    trait: str  # adjective: "curious"
    friend: str  # best friend's name
    skill: str  # "hop very high"

    @property
    def him(self) -> str:
        return {"he": "him", "she": "her"}[self.he]

    @property
    def his(self) -> str:
        return {"he": "his", "she": "her"}[self.he]

    @property
    def a_kind(self) -> str:
        return an(self.kind)

    @property
    def is_child(self) -> bool:
        return self.kind in ("girl", "boy")


CHARACTERS = [
    Character("Pip", "rabbit", "he", "the Green Forest", "carrots", "orange", "curious", "Rosie", "hop very high"),
    Character("Rosie", "fox", "she", "the Green Forest", "berries", "red", "clever", "Pip", "run very fast"),
    Character("Benny", "bear", "he", "Honey Hill", "honey", "brown", "gentle", "Olive", "climb tall trees"),
    Character("Olive", "owl", "she", "the Old Oak", "books", "purple", "wise", "Benny", "see in the dark"),
    Character("Milo", "mouse", "he", "the Little Barn", "cheese", "yellow", "brave", "Daisy", "squeeze through tiny holes"),
    Character("Daisy", "duck", "she", "Willow Pond", "bread", "white", "cheerful", "Milo", "swim very well"),
    Character("Toby", "turtle", "he", "Willow Pond", "lettuce", "green", "patient", "Sam", "hold his breath for a long time"),
    Character("Lily", "girl", "she", "Sunny Village", "flowers", "pink", "kind", "Max", "draw beautiful pictures"),
    Character("Max", "boy", "he", "Sunny Village", "kites", "blue", "funny", "Lily", "tell funny jokes"),
    Character("Sam", "squirrel", "he", "the Tall Pine", "nuts", "brown", "busy", "Toby", "jump from branch to branch"),
    Character("Hazel", "hedgehog", "she", "the Quiet Meadow", "apples", "gold", "shy", "Ruby", "roll into a ball"),
    Character("Ruby", "robin", "she", "the Cherry Tree", "songs", "red", "happy", "Hazel", "sing sweet songs"),
    Character("Leo", "lion", "he", "the Big Rock", "naps", "gold", "proud", "Zoe", "roar very loudly"),
    Character("Zoe", "zebra", "she", "the Windy Plain", "grass", "black and white", "lively", "Leo", "gallop across the plain"),
    Character("Finn", "frog", "he", "Lily Pad Lake", "bugs", "green", "silly", "Bella", "jump very far"),
    Character("Bella", "bunny", "she", "the Quiet Meadow", "clover", "white", "sweet", "Finn", "wiggle her nose"),
    Character("Oscar", "otter", "he", "Silver River", "fish", "silver", "playful", "Mia", "float on his back"),
    Character("Mia", "girl", "she", "Sunny Village", "cookies", "yellow", "helpful", "Oscar", "bake tasty cookies"),
    Character("Tom", "cat", "he", "the Red House", "milk", "gray", "lazy", "Ben", "land on his feet"),
    Character("Ben", "dog", "he", "the Red House", "bones", "brown", "loyal", "Tom", "dig deep holes"),
    Character("Poppy", "pig", "she", "Sunny Farm", "mud", "pink", "messy", "Gus", "find lost things"),
    Character("Gus", "goat", "he", "Sunny Farm", "hay", "white", "stubborn", "Poppy", "climb steep rocks"),
    Character("Ella", "elephant", "she", "the Blue Lake", "peanuts", "gray", "gentle", "Kiki", "spray water with her trunk"),
    Character("Kiki", "kitten", "she", "the Red House", "yarn", "orange", "curious", "Ella", "purr very softly"),
]  # fmt: skip
BY_NAME = {c.name: c for c in CHARACTERS}
FOOD_LIKES = {c.likes for c in CHARACTERS} - {"books", "songs", "naps", "kites", "flowers", "yarn", "mud"}

PLACES = [
    "the park", "the beach", "the river", "the meadow", "the forest", "the garden", "the farm", "the market",
    "the hill", "the lake", "the village", "the orchard", "the library", "the bakery", "the playground",
    "the old bridge", "the big field", "the cave", "the pond", "the school",
]  # fmt: skip
OBJECTS = [
    ("ball", "a"), ("kite", "a"), ("hat", "a"), ("scarf", "a"), ("book", "a"), ("key", "a"), ("shell", "a"),
    ("stone", "a"), ("toy boat", "a"), ("drum", "a"), ("basket", "a"), ("umbrella", "an"), ("blanket", "a"),
    ("cup", "a"), ("bell", "a"), ("map", "a"), ("feather", "a"), ("button", "a"), ("balloon", "a"),
    ("whistle", "a"),
]  # fmt: skip
COLORS = ["red", "blue", "green", "yellow", "orange", "purple", "pink", "white", "brown", "silver", "gold"]
CHARACTER_ADJ = ["little", "small", "young", "friendly", "happy", "cheerful"]
SIZES = ["little", "big", "tiny", "small", "shiny", "old", "new", "soft", "round"]
HIDING = [
    "under a big leaf", "behind a rock", "inside an old log", "next to the river", "under the bed",
    "in a pile of hay", "on top of a tall tree", "behind the door", "under a bush", "in the tall grass",
    "beside the garden gate", "under a wooden bench",
]  # fmt: skip
GAMES = [
    "hide and seek",
    "tag",
    "catch",
    "leapfrog",
    "a guessing game",
    "follow the leader",
    "ring around the rosie",
]
FOODS = [
    ("cake", "a"), ("pie", "a"), ("soup", "some"), ("bread", "some"), ("muffins", "some"), ("cookies", "some"),
    ("pancakes", "some"), ("apple tart", "an"),
]  # fmt: skip
INGREDIENTS = ["flour", "eggs", "sugar", "milk", "butter", "berries", "honey", "apples", "nuts", "carrots"]
FEARS = [
    ("the dark", "dark"), ("thunder", "loud"), ("deep water", "deep"), ("the big hill", "tall"),
    ("the old cave", "dark"), ("the wind", "strong"),
]  # fmt: skip
SIGHTS = [
    "a rainbow", "the tall mountain", "the sea", "a field of flowers", "the old lighthouse", "a waterfall",
    "the big red barn", "the sunset", "the castle on the hill", "the full moon",
]  # fmt: skip
TIMES = [
    "Once upon a time", "One sunny morning", "One rainy day", "Long ago", "One warm afternoon",
    "One cold winter day", "One spring morning", "Early one morning", "One windy day", "One summer evening",
]  # fmt: skip
FEELINGS_GOOD = ["happy", "glad", "proud", "excited", "joyful"]
FEELINGS_BAD = ["sad", "worried", "upset", "lonely", "scared"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve"]  # fmt: skip


def an(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


class Story:
    """Sentences about a hero and a friend, drawn from `rng`."""

    def __init__(self, rng: random.Random, hero: Character | None = None):
        self.rng = rng
        self.hero = hero or rng.choice(CHARACTERS)
        # Usually the best friend, sometimes somebody else from the world.
        if rng.random() < 0.6:
            self.friend = BY_NAME[self.hero.friend]
        else:
            self.friend = rng.choice([c for c in CHARACTERS if c is not self.hero])
        self.s: list[str] = []

    def c(self, *options):
        return self.rng.choice(options)

    def say(self, who: Character, line: str) -> None:
        if line.endswith("?"):
            verb = "asked"
        elif line.endswith("!"):
            verb = self.c("cried", "shouted", "said", "laughed")
        else:
            verb = self.c("said", "said", "said", "whispered", "answered")
        if self.rng.random() < 0.5:
            quoted = line[:-1] + "," if line.endswith(".") else line
            self.s.append(f'"{quoted}" {verb} {who.name}.')
        else:
            self.s.append(f'{who.name} {verb}, "{line}"')

    def opening(self) -> None:
        h, c = self.hero, self.c
        time = c(*TIMES)
        kind = f"{c(*CHARACTER_ADJ, h.trait)} {h.kind}" if self.rng.random() < 0.7 else h.kind
        self.s.append(
            c(
                f"{time}, there was {an(kind)} named {h.name}.",
                f"{time}, {an(kind)} called {h.name} lived in {h.home}.",
                f"{h.name} was {an(kind)} who lived in {h.home}.",
                f"In {h.home}, there lived {an(kind)} named {h.name}.",
                f"Early one morning, {h.name} the {h.kind} woke up in {h.home}.",
            )
        )
        if self.rng.random() < 0.7:
            self.s.append(
                c(
                    f"{cap(h.he)} loved {h.likes} more than anything.",
                    f"{h.name} was very {h.trait}, and {h.he} loved {h.likes}.",
                    f"{cap(h.he)} could {h.skill}.",
                    f"Every day, {h.name} liked to play outside with {h.his} friends.",
                    f"{h.name}'s favorite color was {h.color}.",
                    f"{cap(h.his)} best friend was {h.friend}.",
                )
            )

    def ending(self, moral: str) -> None:
        h, f, c = self.hero, self.friend, self.c
        self.s.append(
            c(
                f"From that day on, {h.name} and {f.name} were the best of friends.",
                f"That night, {h.name} went to sleep with a big smile.",
                f"{h.name} and {f.name} walked home together, tired but {c(*FEELINGS_GOOD)}.",
                f"It was the best day {h.name} ever had.",
                "And they all lived happily ever after.",
                f"When the sun went down, everyone went home {c(*FEELINGS_GOOD)}.",
            )
        )
        if self.rng.random() < 0.6:
            self.s.append(moral)

    # ------------------------------------------------------------------ plots
    def lost_item(self) -> None:
        h, f, c, rng = self.hero, self.friend, self.c, self.rng
        obj, _ = c(*OBJECTS)
        adj = c(*COLORS, *SIZES)
        place, hide = c(*PLACES), c(*HIDING)
        self.s.append(
            c(
                f"{cap(h.he)} had {an(adj)} {obj} that {h.he} loved very much.",
                f"{h.name} had a {adj} {obj}. It was {h.his} favorite thing in the whole world.",
            )
        )
        self.s.append(
            c(
                f"One day, {h.name} went to {place} to play, and {h.his} {obj} was gone!",
                f"But one day, {h.name} could not find {h.his} {obj} anywhere.",
                f"After playing at {place}, {h.name} saw that {h.his} {obj} was missing.",
            )
        )
        self.s.append(f"{h.name} felt very {c(*FEELINGS_BAD)}.")
        looked = rng.sample(HIDING, 2)
        self.s.append(
            f"{cap(h.he)} looked {looked[0]}. {cap(h.he)} looked {looked[1]}. But the {obj} was not there."
        )
        self.s.append(
            c(
                f"Then {f.name} the {f.kind} came by.",
                f"Just then, {h.his} friend {f.name} walked over.",
                f"Soon {f.name} saw {h.name} and came to help.",
            )
        )
        self.say(f, c(f"Why are you so sad, {h.name}?", "What is wrong?", f"Are you okay, {h.name}?"))
        self.say(
            h, c(f"I lost my {obj}!", f"I cannot find my {adj} {obj}.", f"My {obj} is gone and I miss it.")
        )
        self.say(f, c("Do not worry. I will help you look.", "Let us find it together!", "I can help you!"))
        if rng.random() < 0.5:
            self.s.append(
                c(f"{f.name} looked high and low.", f"They looked near {place} and all along the path.")
            )
        self.s.append(
            c(
                f"They looked everywhere. At last, {f.name} found the {obj} {hide}.",
                f"They searched and searched. Finally, {h.name} saw something {adj} {hide}. It was the {obj}!",
                f"After a long time, they found the {obj} {hide}.",
            )
        )
        self.say(h, c(f"Thank you, {f.name}!", "You are the best friend ever!", "Thank you for helping me!"))
        self.ending(
            c(
                "Friends help each other when things go wrong.",
                f"{h.name} learned that it is easier to look for something with a friend.",
                f"From then on, {h.name} always kept {h.his} {obj} in a safe place.",
            )
        )

    def new_friend(self) -> None:
        h, f, c = self.hero, self.friend, self.c
        place = c(*PLACES)
        self.s.append(
            c(
                f"{h.name} went to {place}, but nobody was there to play with {h.him}.",
                f"{h.name} felt {c('lonely', 'bored', 'sad')} because {h.he} had nobody to play with.",
            )
        )
        self.s.append(
            c(
                f"Then {h.he} saw {an(f.kind)} sitting alone under a tree.",
                f"Then {h.he} saw {an(f.kind)} by the {c('river', 'pond', 'path', 'fence', 'big rock')}.",
            )
        )
        self.say(
            h, c("Hello! What is your name?", "Hi! Do you want to play with me?", "Hello there! Who are you?")
        )
        self.say(f, c(f"My name is {f.name}.", f"I am {f.name}. I live in {f.home}."))
        game = c(*GAMES)
        self.say(h, c(f"Do you want to play {game}?", f"Let us play {game}!", f"Can you play {game}?"))
        self.s.append(
            c(
                f"{f.name} smiled and said yes. They played {game} all afternoon.",
                f"So they played {game} until the sun went down.",
                f"They laughed and played {game} for a long time.",
            )
        )
        if self.rng.random() < 0.6:
            self.s.append(
                c(
                    f"{f.name} showed {h.name} how to {f.skill}.",
                    f"{h.name} showed {f.name} how to {h.skill}.",
                    f"They shared some {h.likes} and talked about their favorite things.",
                )
            )
        self.ending(
            c(
                "A new friend can make any day better.",
                f"{h.name} learned that saying hello is the first step to a new friendship.",
                "It is good to be kind to someone who is alone.",
            )
        )

    def storm(self) -> None:
        h, f, c = self.hero, self.friend, self.c
        place = c(*PLACES)
        self.s.append(
            c(
                f"{h.name} and {f.name} went to {place} to play.",
                f"{h.name} and {h.his} friend {f.name} were playing at {place}.",
            )
        )
        self.s.append(
            c(
                "Suddenly, the sky turned dark and the wind began to blow.",
                "Then big gray clouds covered the sun.",
                "After a while, it started to rain very hard.",
            )
        )
        self.s.append(
            c(
                "Boom! Thunder rolled across the sky.",
                "Drip, drop, drip, drop went the rain.",
                "The trees shook in the wind.",
            )
        )
        self.say(f, c("We need to find a dry place!", "Quick, let us hide!", "I am getting wet!"))
        shelter = c(
            "a big hollow tree", "a small cave", "an old barn", "a wooden shed", "a big mushroom", "a bridge"
        )
        self.s.append(
            c(
                f"They ran to {shelter} and waited there.",
                f"{h.name} saw {shelter} nearby, and they hid inside.",
            )
        )
        self.s.append(
            c(
                f"While they waited, {h.name} told {f.name} a story, and {f.name} laughed.",
                "They sat close together to keep warm.",
                f"{f.name} was scared, so {h.name} held {f.his} hand.",
            )
        )
        self.s.append(
            c(
                "Soon the rain stopped and the sun came out again.",
                "After a while, the storm was over.",
                "At last the clouds went away, and there was a beautiful rainbow in the sky.",
            )
        )
        self.ending(
            c(
                "Storms do not last forever.",
                "When you are with a friend, even a storm is not so scary.",
                f"{h.name} learned that it is good to stay calm when things are scary.",
            )
        )

    def baking(self) -> None:
        h, f, c, rng = self.hero, self.friend, self.c, self.rng
        food, art = c(*FOODS)
        a_food = f"{art} {food}"
        self.s.append(
            c(
                f"It was {f.name}'s birthday, and {h.name} wanted to bake {a_food} for {f.him}.",
                f"{h.name} wanted to make {a_food} to surprise {f.name}.",
            )
        )
        ing = rng.sample(INGREDIENTS, 3)
        self.s.append(f"{cap(h.he)} needed {ing[0]}, {ing[1]}, and {ing[2]}.")
        self.s.append(
            c(
                f"{cap(h.he)} went to the market to buy the {ing[2]}.",
                f"{cap(h.he)} found the {ing[0]} and the {ing[1]} in the kitchen, but there was no {ing[2]}.",
                f"{cap(h.he)} put everything on the table and began to mix.",
            )
        )
        if rng.random() < 0.6:
            self.s.append(
                c(
                    "Oh no! The bowl fell on the floor, and there was a big mess.",
                    f"Puff! A cloud of {ing[0]} went everywhere, and {h.name} was all white.",
                    f"{h.name} mixed too fast, and the {ing[1]} spilled.",
                )
            )
            self.s.append(
                c(
                    f"But {h.name} did not give up. {cap(h.he)} cleaned up and tried again.",
                    f"{h.name} laughed, cleaned the kitchen, and started again.",
                )
            )
        self.s.append(
            c(
                f"At last, the {food} was ready. It smelled so good!",
                f"After a long time in the oven, the {food} was warm and sweet.",
            )
        )
        self.s.append(
            c(
                f"{h.name} brought the {food} to {f.name}.",
                f"{h.name} carried the {food} all the way to {f.home}.",
            )
        )
        self.say(
            f,
            c(
                f"Thank you, {h.name}! This is the best {food} ever!",
                "What a wonderful surprise!",
                "Yum! I love it!",
            ),
        )
        self.s.append(
            c(
                f"They ate the {food} together and sang songs.",
                f"They shared the {food} with all their friends.",
            )
        )
        self.ending(
            c(
                "A gift made with love is the best gift of all.",
                f"{h.name} learned that it is okay to make mistakes if you keep trying.",
                "Sharing food with friends makes it taste even better.",
            )
        )

    def race(self) -> None:
        h, f, c = self.hero, self.friend, self.c
        goal = c(
            "the big tree", "the old bridge", "the top of the hill", "the river", "the red barn", "the pond"
        )
        self.s.append(
            c(
                f"One day, {h.name} met {f.name} at {c(*PLACES)}.",
                f"{h.name} liked to run and play with {f.name}.",
                f"One morning, {h.name} and {f.name} were walking by {c(*PLACES)}.",
            )
        )
        self.say(
            h,
            c(
                f"I am the fastest in {h.home}!",
                "Nobody can beat me in a race!",
                f"I bet I can run to {goal} before you!",
            ),
        )
        self.say(f, c("Let us have a race, then.", "Okay, let us see who is faster.", "I will try my best."))
        self.s.append(f"So {h.name} and {f.name} decided to race to {goal}.")
        self.s.append(
            c(
                "Ready, set, go! They started to run.",
                "On the count of three, they ran as fast as they could.",
            )
        )
        if self.rng.random() < 0.5:
            self.s.append(
                c(
                    f"{h.name} ran very fast and was far ahead. {cap(h.he)} thought {h.he} had time for a nap.",
                    f"{h.name} was so far in front that {h.he} stopped to eat some {h.likes}.",
                )
            )
            self.s.append(f"But {f.name} kept going, slow and steady, and passed {h.name}.")
            self.s.append(
                c(
                    f"When {h.name} woke up, {f.name} was already at {goal}!",
                    f"{h.name} ran as fast as {h.he} could, but {f.name} got there first.",
                )
            )
            moral = "Slow and steady wins the race."
        else:
            self.s.append(f"They ran side by side all the way to {goal}.")
            self.s.append(
                c(
                    "In the end, they got there at the same time!",
                    f"{h.name} won, but only by a little bit.",
                    f"{f.name} won, but {h.name} was not upset.",
                )
            )
            moral = "It is more fun to play together than to win."
        self.say(
            h, c("That was fun! Let us race again tomorrow.", "Good race, friend!", "You did very well!")
        )
        self.ending(moral)

    def fear(self) -> None:
        h, f, c = self.hero, self.friend, self.c
        thing, adj = c(*FEARS)
        self.s.append(
            c(
                f"{h.name} was afraid of {thing}.",
                f"There was one thing {h.name} did not like. {cap(h.he)} was scared of {thing}.",
            )
        )
        self.s.append(
            c(
                f"Whenever {h.he} thought about {thing}, {h.his} heart went thump, thump, thump.",
                f"{cap(h.he)} always stayed far away from {thing}.",
            )
        )
        self.s.append(
            c(
                f"One day, {f.name} needed help, and the only way to reach {f.him} was past {thing}.",
                f"One day, {f.name} asked {h.name} to come and see something special beyond {thing}.",
            )
        )
        self.say(h, c("I am too scared.", f"But {thing} is so {adj}!", "I do not think I can do it."))
        self.say(
            f,
            c(
                "You are braver than you think.",
                "I will be right here with you.",
                "Take a deep breath. You can do it.",
            ),
        )
        self.s.append(
            c(
                f"{h.name} took a deep breath and took one small step, then another.",
                f"{h.name} closed {h.his} eyes, counted to three, and went forward.",
            )
        )
        self.s.append(
            c(
                "It was not so bad after all!",
                f"Soon {h.name} was on the other side, and {h.he} felt very proud.",
            )
        )
        self.ending(
            c(
                "Being brave does not mean you are not scared. It means you try anyway.",
                f"{h.name} learned that {h.he} was braver than {h.he} thought.",
                f"From that day on, {h.name} was not afraid of {thing} anymore.",
            )
        )

    def sharing(self) -> None:
        h, f, c, rng = self.hero, self.friend, self.c, self.rng
        n = rng.randint(4, 10)
        item = c("apple", "cookie", "berry", "nut", "carrot", "plum", "cherry", "pear")
        plural_item = {"berry": "berries", "cherry": "cherries"}.get(item, item + "s")
        self.s.append(
            c(
                f"{h.name} found {NUMBER_WORDS[n]} {plural_item} on the way home.",
                f"{h.name} had a basket with {NUMBER_WORDS[n]} {plural_item}.",
            )
        )
        self.s.append(
            c(
                f"{cap(h.he)} wanted to eat them all by {h.him}self.",
                f"{cap(h.he)} was very happy and wanted to keep them all.",
            )
        )
        self.s.append(
            c(
                f"Then {h.he} saw {f.name}, who looked very hungry.",
                f"On the path, {h.he} met {f.name}. {cap(f.he)} had nothing to eat.",
            )
        )
        self.say(f, c(f"Those {plural_item} look so good.", "I am so hungry. I have not eaten all day."))
        self.s.append(f"{h.name} thought for a moment.")
        k = n // 2
        self.s.append(
            c(
                f"Then {h.he} gave {NUMBER_WORDS[k]} {plural_item} to {f.name} and kept {NUMBER_WORDS[n - k]}.",
                f"Then {h.he} shared the {plural_item} with {f.name}, and they each had {NUMBER_WORDS[k]}.",
            )
        )
        self.say(f, c(f"Thank you, {h.name}! You are so kind.", "This is very nice of you!"))
        self.s.append(
            c(
                f"Eating together made {h.name} even happier than eating alone.",
                "They sat on the grass and ate the fruit together.",
            )
        )
        self.ending(
            c(
                "Sharing makes everyone happy.",
                "When you share, you get a friend too.",
                f"{h.name} learned that sharing is caring.",
            )
        )

    def trip(self) -> None:
        h, f, c, rng = self.hero, self.friend, self.c, self.rng
        sight = c(*SIGHTS)
        place = c(*PLACES)
        self.s.append(
            c(
                f"{h.name} and {f.name} wanted to see {sight}.",
                f"{f.name} told {h.name} about {sight}, and {h.name} wanted to see it too.",
            )
        )
        self.s.append(
            c(
                f"So they packed a bag with some {h.likes if h.likes in FOOD_LIKES else 'snacks'} and set off.",
                f"They packed a lunch and walked past {place}.",
            )
        )
        seen = rng.sample(["a busy bee", "a sleepy cat", "a big green frog", "a family of ducks", "a tall windmill",
                           "a little bridge", "a field of sunflowers", "a friendly cow", "a flock of birds",
                           "an old stone wall"], 3)  # fmt: skip
        self.s.append(f"On the way, they saw {seen[0]}, {seen[1]}, and {seen[2]}.")
        self.say(f, c("Are we there yet?", "My feet are tired.", "How much longer?"))
        self.say(h, c("Just a little more!", "Almost there!", "Look, I can see it!"))
        self.s.append(
            c(
                f"At last, they saw {sight}. It was more beautiful than they had imagined.",
                f"When they got to the top of the hill, there was {sight}, shining and bright.",
            )
        )
        self.s.append(
            c("They sat down and looked at it for a long time.", "They did not say a word. They just smiled.")
        )
        self.ending(
            c(
                "Some things are worth a long walk.",
                "The world is full of wonderful things to see.",
                f"{h.name} wanted to go on another trip very soon.",
            )
        )

    def counting(self) -> None:
        h, f, c, rng = self.hero, self.friend, self.c, self.rng
        item = c("shell", "stone", "flower", "leaf", "acorn", "feather", "button", "star")
        plural_item = {"leaf": "leaves"}.get(item, item + "s")
        a, b = rng.randint(2, 6), rng.randint(1, 5)
        self.s.append(
            c(
                f"{h.name} liked to collect {plural_item}.",
                f"{h.name} wanted to collect pretty {plural_item} at {c(*PLACES)}.",
            )
        )
        self.s.append(f"In the morning, {h.he} found {NUMBER_WORDS[a]} {plural_item}.")
        self.s.append(f"In the afternoon, {f.name} helped, and they found {NUMBER_WORDS[b]} more.")
        self.say(f, c(f"How many {plural_item} do you have now?", "How many is that?"))
        self.s.append(f"{h.name} counted them one by one.")
        self.say(
            h,
            f"I have {NUMBER_WORDS[a + b]} {plural_item}! {cap(NUMBER_WORDS[a])} and {NUMBER_WORDS[b]} make {NUMBER_WORDS[a + b]}.",
        )
        if rng.random() < 0.5:
            g = rng.randint(1, a + b - 1)
            self.s.append(
                f"{h.name} gave {NUMBER_WORDS[g]} to {f.name}, so {h.he} had {NUMBER_WORDS[a + b - g]} left."
            )
        self.s.append(
            c(
                f"{h.name} put the {plural_item} in a little box.",
                f"{h.name} lined up all the {plural_item} in a row.",
            )
        )
        self.ending(c("Counting is fun when you do it with a friend.", "Little things can be treasures too."))

    PLOTS = ("lost_item", "new_friend", "storm", "baking", "race", "fear", "sharing", "trip", "counting")

    def tell(self, plot: str | None = None, opening: bool = True) -> str:
        if opening:
            self.opening()
        getattr(self, plot or self.rng.choice(self.PLOTS))()
        return " ".join(self.s)


def paragraphs(text_sentences: list[str], rng: random.Random) -> str:
    """Sentences into two to four paragraphs."""
    n = len(text_sentences)
    cuts = sorted(rng.sample(range(2, n - 1), k=min(rng.randint(1, 3), max(0, n - 3)))) if n > 4 else []
    out, last = [], 0
    for cpos in [*cuts, n]:
        out.append(" ".join(text_sentences[last:cpos]))
        last = cpos
    return "\n\n".join(p for p in out if p)


def make_stories(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        st = Story(rng)
        st.tell()
        texts.append(paragraphs(st.s, rng))
    return texts


def make_eval_stories(n: int, seed: int, train: list[str]) -> list[str]:
    """Held-out stories: drawn like the training ones, with repeats of a training story left out
    (a seeded pool twice the size, filtered, so the result is fixed)."""
    seen = set(train)
    held_out = [t for t in make_stories(2 * n, seed) if t not in seen]
    assert len(held_out) >= n, "the grammar repeats itself too much for a held-out set"
    return held_out[:n]


# =========================================================================== chat
def fact_qa(rng: random.Random, ch: Character) -> tuple[str, str]:
    """One question about a character and its answer, both consistent with the world."""
    friend = BY_NAME[ch.friend]
    kind = "animal" if not ch.is_child else "child"
    qas = [
        (f"Who is {ch.name}?",
         f"{ch.name} is {ch.a_kind} who lives in {ch.home}. {cap(ch.he)} is very {ch.trait} and loves {ch.likes}."),
        (f"What kind of {kind} is {ch.name}?", f"{ch.name} is {ch.a_kind}."),
        (f"Where does {ch.name} live?", f"{ch.name} lives in {ch.home}."),
        (f"What does {ch.name} love?", f"{ch.name} loves {ch.likes}."),
        (f"What does {ch.name} like to eat?" if ch.likes in FOOD_LIKES else f"What does {ch.name} like most?", f"{ch.name} likes {ch.likes} more than anything."),
        (f"Who is {ch.name}'s best friend?",
         f"{ch.name}'s best friend is {friend.name}, {friend.a_kind} from {friend.home}."),
        (f"What is {ch.name}'s favorite color?", f"{ch.name}'s favorite color is {ch.color}."),
        (f"What can {ch.name} do?", f"{ch.name} can {ch.skill}."),
        (f"Is {ch.name} {ch.trait}?", f"Yes, {ch.name} is very {ch.trait}."),
        (f"Tell me about {ch.name}.",
         f"{ch.name} is {ch.a_kind} from {ch.home}. {cap(ch.his)} best friend is {friend.name}, "
         f"{ch.his} favorite color is {ch.color}, and {ch.he} can {ch.skill}."),
    ]  # fmt: skip
    return rng.choice(qas)


def math_qa(rng: random.Random) -> tuple[str, str]:
    op = rng.choice(["plus", "minus", "times", "story_add", "story_sub"])
    a, b = rng.randint(1, 12), rng.randint(1, 12)
    if op == "plus":
        return rng.choice(
            [f"What is {a} plus {b}?", f"What is {a} + {b}?", f"Can you add {a} and {b}?"]
        ), f"{a} plus {b} is {a + b}."
    if op == "minus":
        a, b = max(a, b), min(a, b)
        return rng.choice([f"What is {a} minus {b}?", f"What is {a} - {b}?"]), f"{a} minus {b} is {a - b}."
    if op == "times":
        a, b = rng.randint(1, 6), rng.randint(1, 6)
        return rng.choice([f"What is {a} times {b}?", f"What is {a} x {b}?"]), f"{a} times {b} is {a * b}."
    ch = rng.choice(CHARACTERS)
    item = rng.choice(["apples", "cookies", "shells", "berries", "stones", "flowers"])
    if op == "story_add":
        return (f"{ch.name} has {a} {item} and finds {b} more. How many {item} does {ch.he} have now?",
                f"{ch.name} has {a} + {b} = {a + b} {item} now.")  # fmt: skip
    a, b = max(a, b) + 1, min(a, b)
    return (f"{ch.name} had {a} {item} and gave {b} to {ch.friend}. How many are left?",
            f"{ch.name} has {a} - {b} = {a - b} {item} left.")  # fmt: skip


WORLD_FACTS = [
    ("What color is the sky?", "On a sunny day, the sky is blue."),
    ("What color is grass?", "Grass is green."),
    ("How many legs does a duck have?", "A duck has two legs."),
    ("How many legs does a dog have?", "A dog has four legs."),
    ("What do bees make?", "Bees make honey."),
    ("When do owls fly?", "Owls fly at night. They can see in the dark."),
    ("What comes after Monday?", "Tuesday comes after Monday."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("What is the opposite of big?", "The opposite of big is small."),
    ("What do we see in the sky at night?", "At night we can see the moon and the stars."),
    ("Where do fish live?", "Fish live in water, in rivers, lakes and the sea."),
    ("What falls from the clouds?", "Rain falls from the clouds. When it is very cold, snow falls."),
    ("What color is a banana?", "A ripe banana is yellow."),
    ("How many colors are in a rainbow?", "A rainbow has seven colors."),
    ("What do plants need to grow?", "Plants need water, sunlight and good soil to grow."),
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What would you like to know?"),
    ("Thank you!", "You are welcome!"),
    ("Thanks for your help.", "You are welcome. Have a nice day!"),
    ("Who are you?", "I am a helpful assistant. I can answer questions and tell short stories."),
    ("Can you tell stories?", "Yes! I can tell short stories about Pip, Rosie, Benny and all their friends."),
]  # fmt: skip


def short_story(rng: random.Random, ch: Character) -> str:
    st = Story(rng, hero=ch)
    st.tell(rng.choice(("lost_item", "new_friend", "sharing", "race", "counting", "fear")))
    # Keep answers within a 256-token context: the first ~9 sentences.
    return " ".join(st.s[:9])


def one_turn(rng: random.Random) -> tuple[str, str]:
    r = rng.random()
    if r < 0.45:
        return fact_qa(rng, rng.choice(CHARACTERS))
    if r < 0.7:
        return math_qa(rng)
    if r < 0.82:
        return rng.choice(WORLD_FACTS)
    ch = rng.choice(CHARACTERS)
    q = rng.choice([f"Tell me a short story about {ch.name}.", f"Can you tell me a story about {ch.name}?",
                    f"Please tell a story about {ch.name} the {ch.kind}."])  # fmt: skip
    return q, short_story(rng, ch)


def make_chats(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        turns = rng.choices([1, 2, 3], weights=[5, 3, 2])[0]
        if turns > 1 and rng.random() < 0.5:
            # A follow-up conversation about one character.
            ch = rng.choice(CHARACTERS)
            seen = set()
            for _ in range(turns):
                q, a = fact_qa(rng, ch)
                if q in seen:
                    continue
                seen.add(q)
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        else:
            for _ in range(turns):
                q, a = one_turn(rng)
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        chats.append({"messages": msgs})
    return chats


# =========================================================================== tokenizer
def train_tokenizer(texts: list[str], out_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    # add_special_tokens=True puts a BOS in front (as Llama tokenizers do); the data pipeline
    # appends the EOS that ends each document.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    _portable_config(out_dir)
    return tok.get_vocab_size()


def _portable_config(out_dir: Path) -> None:
    """Rewrite tokenizer_config.json in the form every transformers >= 4.45 reads: transformers
    5 writes a v5-only class name, a list of `extra_special_tokens` and a separate
    chat_template.jinja (4.x before 4.50 ignores that file); 5.x reads this form as well."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg["chat_template"] = CHAT_TEMPLATE
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def llama_config(vocab_size: int, tok_dir: Path) -> dict:
    t = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = {a["content"]: a["id"] for a in t["added_tokens"]}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 192,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "use_cache": True,
        "dtype": "float32",
    }


# =========================================================================== main
def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def generate(out: Path) -> None:
    stories = make_stories(N_STORIES, STORY_SEED)
    eval_stories = make_eval_stories(N_EVAL_STORIES, EVAL_STORY_SEED, stories)
    chats = make_chats(N_CHATS, CHAT_SEED)
    write_jsonl(out / "data" / "stories.jsonl", [{"text": t} for t in stories])
    write_jsonl(out / "data" / "stories_eval.jsonl", [{"text": t} for t in eval_stories])
    write_jsonl(out / "chat" / "data.jsonl", chats)
    # The tokenizer learns the chat layout too, so the roles and the template's newlines are
    # cheap tokens in the chat fine-tune.
    chat_texts = [
        "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in c["messages"]) for c in chats
    ]
    vocab = train_tokenizer(stories + chat_texts, out / "tokenizer")
    cfg = llama_config(vocab, out / "tokenizer")
    (out / "tiny-llama").mkdir(parents=True, exist_ok=True)
    (out / "tiny-llama" / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


ASSETS = [
    "data/stories.jsonl",
    "data/stories_eval.jsonl",
    "chat/data.jsonl",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
    "tiny-llama/config.json",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=EXAMPLES, help="directory to write into (default: examples/)")
    ap.add_argument("--check", action="store_true", help="regenerate into a temp dir and compare with --out")
    args = ap.parse_args(argv)
    if not args.check:
        generate(args.out)
        stories = (args.out / "data" / "stories.jsonl").stat().st_size
        print(f"wrote {args.out}: stories {stories / 1e6:.2f} MB, {N_STORIES} stories, {N_CHATS} chats")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        bad = [a for a in ASSETS if (Path(tmp) / a).exists() != (args.out / a).exists()
               or ((Path(tmp) / a).exists() and not filecmp.cmp(Path(tmp) / a, args.out / a, shallow=False))]  # fmt: skip
    if bad:
        print(f"differ from a fresh generation: {', '.join(bad)}", file=sys.stderr)
        return 1
    print("assets match a fresh generation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
