"""Benchmark prompts: code snippets cut from files the tiny models never trained on.

Three sets: ``heldout`` (continue a snippet: free-form code, little of it repeats the prompt),
``edit`` (a function, then the same function begun again with one name changed: the output
mostly repeats the input, as code edits and refactors do, which is where n-gram drafts pay) and
``prose`` (English text, from the interpreter's own LICENSE: unlike anything the code models
learnt).
"""
from __future__ import annotations

import json
import random
import re
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO / "models" / "prompts.jsonl"
EDIT_PROMPTS = REPO / "models" / "edit_prompts.jsonl"
PROSE_PROMPTS = REPO / "models" / "prose_prompts.jsonl"
HELD_OUT_EVERY = 25   # the tiny-model trainer holds out files with index % 25 == 24


def load_prompts(path: str | Path | None = None, n: int | None = None) -> list[str]:
    """One JSON string per line; `n` cycles through the file if it holds fewer. `path` may also
    name a bundled set: "heldout" (the default), "edit" or "prose"."""
    bundled = {"heldout": DEFAULT_PROMPTS, "edit": EDIT_PROMPTS, "prose": PROSE_PROMPTS}
    path = bundled.get(str(path), path) if path else DEFAULT_PROMPTS
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} not found (make it with "
                                f"`python -m client.prompts --out {path}`)")
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        value = json.loads(line)
        if not isinstance(value, str):
            raise ValueError(f"{path}:{lineno}: each line must be a JSON string")
        prompts.append(value)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    if n is None:
        return prompts
    return [prompts[i % len(prompts)] for i in range(n)]


def _heldout_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idle_test", "site-packages")
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not any(part in skip for part in p.relative_to(stdlib).parts))
    return [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]


def make_edit_prompts(count: int = 64, seed: int = 0, max_lines: int = 14) -> list[str]:
    """"Rewrite this function with one change": a held-out function, then its first line again
    with the function's name changed; the body that should follow is the one above."""
    rng = random.Random(seed)
    functions = []
    for f in _heldout_files():
        lines = f.read_text(errors="replace").splitlines(keepends=True)
        for i, line in enumerate(lines):
            m = re.match(r"(\s*)def (\w+)\(", line)
            if not m:
                continue
            indent, body = m.group(1), [line]
            for nxt in lines[i + 1:i + max_lines]:
                if nxt.strip() and not nxt.startswith(indent + " "):
                    break
                body.append(nxt)
            text = "".join(body).rstrip() + "\n"
            if 4 <= len(body) and len(text) < 700:
                functions.append((m.group(2), text, line))
    rng.shuffle(functions)
    prompts = []
    for name, text, first in functions[:count]:
        new_name = name + "_v2"
        prompts.append(f"{text}\n\n# The same function, renamed to {new_name}:\n"
                       + first.replace(f"def {name}(", f"def {new_name}(", 1).lstrip())
    return prompts


def make_prose_prompts(count: int = 32, seed: int = 0, chars: int = 200) -> list[str]:
    """The first `chars` characters of each long paragraph of the stdlib's LICENSE.txt."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(errors="replace")
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if len(p.strip()) > 150]
    return [p[:chars] for p in paragraphs[:count]]


def make_heldout_prompts(count: int = 256, seed: int = 0, min_lines: int = 3,
                         max_lines: int = 12) -> list[str]:
    held_out = _heldout_files()
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        lines = rng.choice(held_out).read_text(errors="replace").splitlines(keepends=True)
        if len(lines) < max_lines + 1:
            continue
        start = rng.randrange(0, len(lines) - max_lines)
        snippet = "".join(lines[start:start + rng.randint(min_lines, max_lines)])
        if snippet.strip() and len(snippet) < 600:
            prompts.append(snippet)
    return prompts


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--count", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", choices=["heldout", "edit", "prose"], default="heldout")
    a = ap.parse_args()
    make = {"heldout": make_heldout_prompts, "edit": make_edit_prompts, "prose": make_prose_prompts}[a.set]
    made = make(a.count, a.seed)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("".join(json.dumps(p) + "\n" for p in made))
    print(f"wrote {len(made)} {a.set} prompts to {a.out}")
