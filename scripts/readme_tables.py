"""Regenerate the config reference and the event table (``docs/reference.md``) from the code.

    python scripts/readme_tables.py     # rewrites docs/reference.md between the table markers

``tests/test_readme.py`` fails when a config key or an event is missing from that page.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from impala_rl import config
from impala_rl.events import ActorEvents, ImpalaEvents, RunEvents, event_specs
from impala_rl.stats import stat_name

ROOT = Path(__file__).resolve().parents[1]


def _field_docs() -> dict[tuple[str, str], str]:
    tree = ast.parse(Path(config.__file__).read_text())
    docs = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for st, nxt in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(st, ast.AnnAssign)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
            ):
                docs[(node.name, st.target.id)] = " ".join(str(nxt.value.value).split())
    return docs


def _default(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return repr(value)
    return str(value)


def config_table() -> str:
    docs = _field_docs()

    def rows(cls: type, prefix: str) -> list[str]:
        out = []
        instance = cls()
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                out += rows(type(value), f"{prefix}{f.name}.")
            else:
                doc = docs.get((cls.__name__, f.name), "")
                out.append(f"| `{prefix}{f.name}` | `{_default(value)}` | {doc} |")
        return out

    return "\n".join(
        ["| key | default | meaning |", "| --- | --- | --- |", *rows(config.RunConfig, "")]
    )


def event_table() -> str:
    lines = ["| event | statistics per epoch | meaning |", "| --- | --- | --- |"]
    for iface in (ImpalaEvents, ActorEvents, RunEvents):
        for name, spec in sorted(event_specs(iface).items()):
            key = f"/<{spec.group_by}>" if spec.group_by else ""
            outs = ", ".join(f"`{stat_name(name, o.name)}{key}`" for o in spec.outputs)
            doc = " ".join(spec.doc.split())  # a docstring's lines, one table row
            call = f"{iface.__name__}.{name}({', '.join(spec.fields)})"
            lines.append(f"| `{call}` | {outs} | {doc} |")
    return "\n".join(lines)


def replace_between(text: str, marker: str, body: str) -> str:
    pattern = re.compile(
        rf"(<!-- {marker} start -->\n).*?(\n<!-- {marker} end -->)", flags=re.DOTALL
    )
    if not pattern.search(text):
        raise SystemExit(f"docs/reference.md lacks the <!-- {marker} start/end --> markers")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text)


def main() -> None:
    page = ROOT / "docs" / "reference.md"
    text = page.read_text()
    text = replace_between(text, "config-table", config_table())
    text = replace_between(text, "event-table", event_table())
    page.write_text(text)


if __name__ == "__main__":
    main()
