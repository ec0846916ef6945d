"""The documentation stays true: the reference tables (docs/reference.md) list every config key
and event, the commands quoted in the README and docs/ build valid configs, and every link
resolves."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from impala_rl.config import PRESETS_DIR, RunConfig, list_presets, load_config
from impala_rl.events import ActorEvents, ImpalaEvents, RunEvents, event_specs

ROOT = Path(__file__).resolve().parents[1]
README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
PAGES = {p: p.read_text() for p in [README_PATH, *sorted((ROOT / "docs").rglob("*.md"))]}


def _between(text: str, marker: str) -> str:
    start, end = f"<!-- {marker} start -->", f"<!-- {marker} end -->"
    assert start in text and end in text, f"the page lacks the {marker} markers"
    return text[text.index(start) : text.index(end)]


def _keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            keys += _keys(type(value), f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_config_key_is_in_the_reference():
    table = _between(REFERENCE, "config-table")
    missing = [k for k in _keys(RunConfig) if f"`{k}`" not in table]
    assert not missing, f"docs/reference.md's config table lacks {missing}"


def test_every_event_is_in_the_reference():
    table = _between(REFERENCE, "event-table")
    missing = [
        f"{iface.__name__}.{name}"
        for iface in (ImpalaEvents, ActorEvents, RunEvents)
        for name in event_specs(iface)
        if f"`{iface.__name__}.{name}(" not in table
    ]
    assert not missing, f"docs/reference.md's event table lacks {missing}"


def test_every_preset_is_in_the_readme_tables():
    presets = _between_headings(README, "## Presets")
    results = _between_headings(README, "## Results")
    missing = [p for p in list_presets() if f"| `{p}`" not in presets or f"| `{p}`" not in results]
    assert not missing, f"README's preset or results table lacks {missing}"


def _between_headings(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


# --- links ------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def _links() -> list[tuple[Path, str]]:
    return [(page, target) for page, text in PAGES.items() for target in LINK.findall(text)]


def test_docs_pages_are_in_place():
    for name in ("results", "performance", "reliability"):
        assert (ROOT / "docs" / f"{name}.md").is_file()
    assert list((ROOT / "docs" / "experiments").glob("*.md"))


@pytest.mark.parametrize(
    "page,target",
    [(p, t) for p, t in _links() if not t.startswith(("http://", "https://", "mailto:"))],
    ids=lambda v: v.name if isinstance(v, Path) else v,
)
def test_relative_links_resolve(page: Path, target: str):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
    if anchor and dest.suffix == ".md":
        anchors = _anchors(PAGES.get(dest, dest.read_text() if dest.is_file() else ""))
        assert anchor in anchors, f"{page.relative_to(ROOT)}: no heading for #{anchor} in {path}"


def test_preset_comments_point_to_existing_docs():
    for preset in PRESETS_DIR.glob("*.yaml"):
        for ref in re.findall(r"docs/[\w/.-]+\.md", preset.read_text()):
            assert (ROOT / ref).is_file(), f"{preset.name} refers to {ref}, which does not exist"


# --- commands ---------------------------------------------------------------------------------

# `impala train PRESET key=value ...` and `benchmarks/learning.py PRESET key=value ...`, in code
# spans, code blocks (with `\` continuations) and table cells.
COMMAND = re.compile(r"(?:impala train|benchmarks/learning\.py) [^`|\n#]*")
PLACEHOLDER = re.compile(r"=([A-Z][A-Z_]*|.*/[A-Z])$")


def _commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for page, text in PAGES.items():
        text = re.sub(r"\\\n\s*", " ", text)
        for match in COMMAND.finditer(text):
            words = shlex.split(match.group(0).split("(", 1)[0].replace("...", ""))
            args = words[2:] if words[0] == "impala" else words[1:]
            if not args or not re.fullmatch(r"[a-z_]+", args[0]) or args[0] not in list_presets():
                continue  # a synopsis (PRESET, --config, --resume) or prose
            overrides = []
            for word in args[1:]:
                if word.startswith("-"):
                    break  # benchmark options and --run-dir come after the overrides
                overrides.append(word)
            if any(PLACEHOLDER.search(w) for w in overrides):
                continue  # e.g. seed=S: a template, not a command
            found.append((page.relative_to(ROOT).as_posix(), args[0], overrides))
    return found


COMMANDS = _commands()


def test_the_docs_quote_commands():
    pages = {page for page, _, _ in COMMANDS}
    assert {"README.md", "docs/results.md", "docs/performance.md"} <= pages
    assert len(COMMANDS) >= 30


@pytest.mark.parametrize(
    "page,preset,overrides", COMMANDS, ids=[f"{p}:{r} {' '.join(o)}" for p, r, o in COMMANDS]
)
def test_documented_command_builds_a_valid_config(page: str, preset: str, overrides: list[str]):
    load_config(preset, [o for o in overrides if "=" in o])
    assert all("=" in o for o in overrides), f"{page}: {preset} {overrides} has a stray word"


def _override_runs() -> list[tuple[str, str, list[str]]]:
    """`impala train --resume RUN key=value ...` and `benchmarks/soak.py ... key=value ...`."""
    found = []
    for page, text in PAGES.items():
        text = re.sub(r"\\\n\s*", " ", text)
        for match in re.finditer(r"(?:impala train --resume|benchmarks/soak\.py) [^`|\n#]*", text):
            words = shlex.split(match.group(0))
            base = "cartpole" if "soak" in words[0] else None  # soak.py trains cartpole
            overrides = [w for w in words if "=" in w and not w.startswith("[")]
            found.append((page.relative_to(ROOT).as_posix(), base, overrides))
    return found


def test_documented_resume_and_soak_overrides_are_valid():
    runs = [run for run in _override_runs() if run[2]]
    assert {"docs/reliability.md", "docs/results.md"} <= {page for page, _, _ in runs}
    for _, base, overrides in runs:
        load_config(base, overrides)


def test_make_train_args_build_a_valid_config():
    for args in re.findall(r'make train ARGS="([^"]+)"', README):
        load_config("cartpole", args.split())
