"""The host kernels' builds (engine/cbuild.py): compiled once, loaded from the cache by the next
build of the same source, flags, compiler and CPU; built again where the cached file is broken;
nothing kept where the cache is off."""

from __future__ import annotations

import os
import stat

import pytest

from megatrain.engine import cbuild

SOURCE = "int answer(void) { return 42; }\n"


@pytest.fixture
def counting_cc(tmp_path, monkeypatch):
    """CC set to a compiler that counts its builds (its `--version` runs are not counted)."""
    log, cc = tmp_path / "builds", tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *" -o "*) echo >> {log};; esac\nexec cc "$@"\n')
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("MEGATRAIN_KERNEL_CACHE", str(tmp_path / "cache"))
    return lambda: len(log.read_text().splitlines()) if log.exists() else 0


def test_a_second_build_loads_the_first_from_the_cache(counting_cc, tmp_path):
    assert cbuild.build(SOURCE, "answer").answer() == 42
    assert counting_cc() == 1
    assert cbuild.build(SOURCE, "answer").answer() == 42
    assert counting_cc() == 1  # loaded, not compiled
    (kept,) = (tmp_path / "cache").iterdir()
    assert kept.name.startswith("answer-") and kept.suffix == ".so"
    # Another source, other flags: builds of their own.
    assert cbuild.build(SOURCE.replace("42", "43"), "answer").answer() == 43
    assert cbuild.build(SOURCE, "answer", ("-DUNUSED",)).answer() == 42
    assert counting_cc() == 3 and len(list((tmp_path / "cache").iterdir())) == 3


def test_a_broken_cached_build_is_built_again(counting_cc, tmp_path):
    kept = cbuild._cached(SOURCE, "answer", os.environ["CC"], cbuild.FLAGS)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"not a library")  # (a library loaded here is never rewritten: it is replaced)
    assert cbuild.build(SOURCE, "answer").answer() == 42
    assert counting_cc() == 1 and kept.read_bytes().startswith(b"\x7fELF")
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]  # no temporary left


def test_another_compiler_is_another_build_and_no_cache_keeps_nothing(counting_cc, tmp_path, monkeypatch):
    cbuild.build(SOURCE, "answer")
    monkeypatch.setenv("CC", "cc")  # another compiler's name: a build of its own
    cbuild.build(SOURCE, "answer")
    assert len(list((tmp_path / "cache").iterdir())) == 2
    monkeypatch.setenv("MEGATRAIN_KERNEL_CACHE", "")
    assert cbuild.cache_dir() is None
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    os.mkdir(tmp_path / "tmp")
    assert cbuild.build(SOURCE, "answer").answer() == 42
    assert len(list((tmp_path / "cache").iterdir())) == 2 and not list((tmp_path / "tmp").iterdir())
