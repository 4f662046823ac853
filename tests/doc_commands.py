"""The fenced blocks of the documentation's pages, their tags, and the dry-run form of a command that needs a GPU.

Every block of commands (``bash``, ``sh``, ``shell`` or ``console``) in README.md and docs/**/*.md names what it needs
in its info string, exactly one of ``title="CPU"``, ``"GPU"``, ``"SLURM"``, ``"S3"`` or ``"NET"``: a CPU block runs
after ``make demo`` from the repository root; the others are checked (``tests/integration/test_doc_commands.py``).
Nothing here starts a process: the unit tests read it in the test process.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

COMMAND_LANGUAGES = ("bash", "sh", "shell", "console")
TAGS = ("CPU", "GPU", "SLURM", "S3", "NET")

_FENCE = re.compile(r"^(?P<indent> {0,3}|\s*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_TITLE = re.compile(r"""\btitle=(?:"([^"]*)"|'([^']*)'|(\S+))""")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Block:
    """A fenced block: its page (relative to the repository root), the line of its opening fence (1-based), its
    language (the info string's first word, lower case), every ``title=`` of its info string, and its text."""

    page: str
    line: int
    language: str
    titles: tuple[str, ...]
    text: str

    @property
    def is_command(self) -> bool:
        return self.language in COMMAND_LANGUAGES

    @property
    def tag(self) -> str | None:
        """The block's one known tag, else None."""
        return self.titles[0] if len(self.titles) == 1 and self.titles[0] in TAGS else None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks(text: str, page: str) -> list[Block]:
    """Every fenced block of a Markdown page, indented ones (in a list item) included; an unclosed block runs to
    the end of the page, as Markdown reads it."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent, info = opening["fence"], len(opening["indent"]), opening["info"].strip()
        body, j = [], i + 1
        while j < len(lines):
            closing = re.match(r"^\s*(`{3,}|~{3,})\s*$", lines[j])
            if closing and closing[1][0] == fence[0] and len(closing[1]) >= len(fence):
                break
            line = lines[j]
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])  # the fence's indent, at most
            j += 1
        words = info.strip("{} ").split()
        language = words[0].lstrip(".").lower() if words and "=" not in words[0] else ""
        titles = tuple(next(v for v in m.groups() if v is not None) for m in _TITLE.finditer(info))
        blocks.append(Block(page, i + 1, language, titles, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def doc_pages(root: Path) -> list[Path]:
    """README.md and every page of docs/, in a fixed order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def all_blocks(root: Path) -> list[Block]:
    return [block for page in doc_pages(root)
            for block in fenced_blocks(page.read_text(encoding="utf-8"), page.relative_to(root).as_posix())]


def tag_problems(blocks: list[Block]) -> list[str]:
    """One line per command block without exactly one known tag, naming its page and line."""
    problems = []
    for block in blocks:
        if not block.is_command or block.tag is not None:
            continue
        if not block.titles:
            what = "has no tag"
        elif len(block.titles) > 1:
            what = f"has {len(block.titles)} tags ({', '.join(block.titles)})"
        else:
            what = f"has the unknown tag {block.titles[0]!r}"
        problems.append(f"{block.where}: the ```{block.language} block {what}: its info string needs exactly one of "
                        + ", ".join(f'title="{tag}"' for tag in TAGS) + f" ({_first_line(block)})")
    return problems


def pages_to_run(blocks: list[Block]) -> dict[str, list[Block]]:
    """``blocks`` by page, in order, less each page's last blocks whose commands an earlier page runs too (the same
    words, in any order: ``key=value`` overrides are written in another order on another page): nothing after them
    on their own page can depend on what they write, so running them again proves nothing new."""
    pages: dict[str, list[Block]] = {}
    for block in blocks:
        pages.setdefault(block.page, []).append(block)
    seen: set[tuple] = set()
    for page_blocks in pages.values():
        while page_blocks and commands_key(page_blocks[-1].text) in seen:
            page_blocks.pop()
        seen.update(commands_key(block.text) for block in page_blocks)
    return {page: page_blocks for page, page_blocks in pages.items() if page_blocks}


def commands_key(script: str) -> tuple:
    """What a script runs, blind to comments, line continuations and the order of each command's words."""
    try:
        return tuple(tuple(sorted(words)) for line in logical_lines(script) if (words := shlex.split(line, comments=True)))
    except ValueError:  # not shell words (an unclosed quote): the text itself
        return (script,)


def _first_line(block: Block) -> str:
    lines = [line for line in block.text.splitlines() if line.strip()]
    return lines[0][:80] if lines else "empty"


def logical_lines(script: str) -> list[str]:
    """The script's lines with backslash continuations joined (a command written over several lines is one)."""
    out, pending = [], ""
    for line in script.splitlines():
        if line.endswith("\\") and not line.endswith("\\\\"):
            pending += (line[:-1].lstrip() if pending else line[:-1]).rstrip() + " "
            continue
        out.append(pending + line.lstrip() if pending else line)
        pending = ""
    if pending:
        out.append(pending)
    return out


def _command_end(line: str, start: int) -> int:
    """Where the command that starts at ``start`` ends: an unquoted ``;``, ``&``, ``|``, parenthesis or comment, or the
    line's end."""
    quote = None
    i = start
    while i < len(line):
        c = line[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = None
        elif c == "\\":
            i += 1
        elif c in "'\"":
            quote = c
        elif c in ";&|()" or (c == "#" and line[i - 1].isspace()):
            return i
        i += 1
    return len(line)


def _command_start(line: str, end: int) -> int:
    """Where the command that holds position ``end`` starts: after the last unquoted ``;``, ``&&``, ``||``, ``|`` or
    ``(`` (a ``$(...)``) before it (the line's start otherwise)."""
    start, i = 0, 0
    while i < end:
        stop = _command_end(line, i)
        if stop >= end:
            return start
        i = stop + 1
        while i < len(line) and line[i] in "&|(":
            i += 1
        start = i
    return start


def _is_assignment(line: str) -> bool:
    """A line that only sets variables (``NAME=value ...`` or ``export NAME=value``), running no command."""
    if "$(" in line or "`" in line:
        return False
    try:
        words = shlex.split(line[:_command_end(line, 0)])
    except ValueError:
        return False
    words = words[1:] if words[:1] == ["export"] else words
    return bool(words) and all(_ASSIGNMENT.match(word) for word in words)


_TRAINING = re.compile(r"(?<![\w/.-])(?:train\.py|slurm/train\.sbatch)(?![\w.-])")


def train_dry_runs(script: str) -> list[str]:
    """The block's variable assignments, then each training command rewritten as its dry run, ``python train.py
    ARGS --dry-run``, with the process count the launcher would announce: ``WORLD_SIZE`` from ``accelerate launch
    --num_processes N``, or for ``sbatch slurm/train.sbatch RECIPE ...`` from ``--nodes`` times ``--gpus-per-node``
    (one process per node without GPUs) with ``LOCAL_WORLD_SIZE``. The command's leading ``NAME=value`` assignments
    are kept. Empty when the block trains nothing."""
    assignments, runs = [], []
    for line in logical_lines(script):
        if _is_assignment(line):
            assignments.append(line[:_command_end(line, 0)].strip())
            continue
        for match in _TRAINING.finditer(line):
            start = _command_start(line, match.start())
            launcher, args = line[start:match.start()], line[match.end():_command_end(line, match.end())].strip()
            env = [*_leading_assignments(launcher), *_world_size(launcher)]
            runs.append(" ".join([*env, "python train.py", *([args] if args else []), "--dry-run"]))
    return assignments + runs if runs else []


_LEADING_ASSIGNMENT = re.compile(r"""\s*([A-Za-z_][A-Za-z0-9_]*=(?:"[^"]*"|'[^']*'|[^\s"'])*)""")


def _leading_assignments(launcher: str) -> list[str]:
    """The ``NAME=value`` words before the command, as written (``$PWD`` is expanded by bash, as for the reader)."""
    out, i = [], 0
    while (match := _LEADING_ASSIGNMENT.match(launcher, i)) and (match.end() == len(launcher)
                                                                 or launcher[match.end()].isspace()):
        out.append(match[1])
        i = match.end()
    return out


def _world_size(launcher: str) -> list[str]:
    """``WORLD_SIZE=N`` (and ``LOCAL_WORLD_SIZE``) as the launcher's options give them; nothing when they do not."""
    options: dict[str, str] = {}
    words = shlex.split(launcher)
    for k, word in enumerate(words):
        if word.startswith("-"):
            name, eq, value = word.partition("=")
            options[name] = value if eq else (words[k + 1] if k + 1 < len(words) else "")
    if "sbatch" in words:
        nodes = int(options.get("--nodes") or options.get("-N") or 2)  # slurm/train.sbatch asks for 2
        per_node = int(options.get("--gpus-per-node") or 1) or 1
        return [f"WORLD_SIZE={nodes * per_node}", f"LOCAL_WORLD_SIZE={per_node}"]
    for name in ("--num_processes", "--nproc_per_node", "--nproc-per-node"):
        if options.get(name):
            return [f"WORLD_SIZE={options[name]}"]
    return []
