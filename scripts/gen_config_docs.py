#!/usr/bin/env python3
"""Write docs/configuration.md from the docstrings of megatrain's configuration keys.

    python scripts/gen_config_docs.py            # (re)write the page
    python scripts/gen_config_docs.py --check    # exit 1 if the committed page differs

The page is the key table `megatrain train --help` prints (megatrain/configdocs.py); run this
after adding a key or changing a key's docstring in megatrain/config.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's megatrain, installed or not

from megatrain.configdocs import PAGE, markdown  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed page, write nothing")
    args = ap.parse_args()
    page, text = ROOT / PAGE, markdown()
    if args.check:
        same = page.is_file() and page.read_text() == text
        print(f"{PAGE}: {'up to date' if same else 'out of date: run python scripts/gen_config_docs.py'}")
        return 0 if same else 1
    tmp = page.with_name(f".{page.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, page)  # a reader never sees half a page
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
