"""The shell commands of one marked block of README.md, for CI to run exactly as a user would.

A block is a fenced code block right after an HTML comment naming it:

    <!-- ci: install -->
    ```bash
    pip install ...
    ```

Usage: python3 .ci/readme_commands.py README.md install   # one command per line on stdout

Blank and comment-only lines are dropped; a line ending in a backslash joins the next one. A
name that is missing, marked twice, or not followed by a fenced block is an error (exit 1).
Standard library only: CI runs it before any dependency is installed.
"""
from __future__ import annotations

import re
import sys

MARKER = re.compile(r"^\s*<!--\s*ci:\s*([\w-]+)\s*-->\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


class ReadmeBlockError(ValueError):
    pass


def marked_blocks(text: str) -> dict[str, list[str]]:
    """{name: the raw lines of the fenced block after ``<!-- ci: name -->``}."""
    lines = text.splitlines()
    blocks: dict[str, list[str]] = {}
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        name = m.group(1)
        if name in blocks:
            raise ReadmeBlockError(f"README: '<!-- ci: {name} -->' appears more than once")
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or not FENCE.match(lines[j]):
            raise ReadmeBlockError(f"README: '<!-- ci: {name} -->' (line {i + 1}) is not followed by "
                                   f"a fenced code block")
        fence = FENCE.match(lines[j]).group(1)
        body = []
        for k in range(j + 1, len(lines)):
            if lines[k].strip().startswith(fence):
                break
            body.append(lines[k])
        else:
            raise ReadmeBlockError(f"README: the block after '<!-- ci: {name} -->' is not closed")
        blocks[name] = body
    return blocks


def commands(block_lines: list[str]) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment-only lines dropped."""
    out, pending = [], ""
    for line in block_lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        cmd = (pending + line).strip()
        pending = ""
        if cmd and not cmd.startswith("#"):
            out.append(cmd)
    if pending.strip():
        out.append(pending.strip())
    return out


def block_commands(text: str, name: str) -> list[str]:
    blocks = marked_blocks(text)
    if name not in blocks:
        raise ReadmeBlockError(f"README has no '<!-- ci: {name} -->' block (found: "
                               f"{', '.join(blocks) or 'none'})")
    cmds = commands(blocks[name])
    if not cmds:
        raise ReadmeBlockError(f"README's '{name}' block has no command")
    return cmds


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    path, name = argv
    try:
        with open(path, encoding="utf-8") as f:
            cmds = block_commands(f.read(), name)
    except (OSError, ReadmeBlockError) as e:
        print(f"readme_commands: {e}", file=sys.stderr)
        return 1
    print("\n".join(cmds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
