"""Builds the demo training corpus from freely licensed text found on this machine.

Sources (both under the PSF licence): the reST sources of the Python 3.11 documentation
(Debian package ``python3.11-doc``) and the docstrings of the standard library itself. The
docstrings also become short chat exchanges ("What does json.dumps do?" -> its summary), so
the demo target answers in the chat format its template produces.
"""
from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import random
import re
import sys
import warnings
from pathlib import Path

DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
LICENCE = "PSF License Agreement (Python documentation and standard library docstrings)"

_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")
_DIRECTIVE = re.compile(r"^\s*\.\. ")
_OPTION = re.compile(r"^\s+:[a-z-]+:")
_RULE = re.compile(r"^([=\-~^\"'`#*+])\1{3,}\s*$")


def clean_rest(text: str) -> str:
    """Turn reST into plain prose and code, dropping markup the model should not learn."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if _DIRECTIVE.match(line):
            # keep the argument of signature-like directives, drop the rest
            m = re.match(r"^\s*\.\. (?:function|method|class|exception|attribute|data)::\s*(.+)$", line)
            out.append(m.group(1) if m else "")
            directive = r"^\s*\.\. (note|warning|versionadded|versionchanged|deprecated|seealso|impl-detail)"
            skipping = m is None and not re.match(directive, line)
            continue
        if skipping and (line.startswith(" ") or not line.strip()):
            if not line.strip():
                skipping = False
            continue
        skipping = False
        if _OPTION.match(line) or _RULE.match(line):
            continue
        line = _ROLE.sub(r"\1", line)
        line = _LINK.sub(r"\1", line)
        line = line.replace("``", "").replace("**", "").replace("::", ":")
        out.append(line.rstrip())
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def doc_texts() -> list[str]:
    if not DOC_SOURCES.is_dir():
        raise SystemExit(
            f"{DOC_SOURCES} not found: install the Python documentation sources first "
            "(Debian: apt-get install -y python3.11-doc)"
        )
    return [clean_rest(p.read_text(encoding="utf-8", errors="replace")) for p in sorted(DOC_SOURCES.rglob("*.rst.txt"))]


def _summary(doc: str) -> str:
    para = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(para.split())


def docstring_pairs() -> list[tuple[str, str]]:
    """(question, answer) pairs from public standard-library docstrings."""
    pairs: list[tuple[str, str]] = []
    names = sorted(m.name for m in pkgutil.iter_modules()
                   if m.module_finder.path.startswith(sys.base_prefix) and "-packages" not in m.module_finder.path)
    skip = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip", "pydoc_data"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if name.startswith("_") or name in skip:
                continue
            try:
                mod = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - some modules need optional system libraries
                continue
            if mod.__doc__:
                pairs.append((f"What is the {name} module for?", _summary(mod.__doc__)))
            for attr, obj in sorted(vars(mod).items()):
                if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                    continue
                if not (inspect.isfunction(obj) or inspect.isclass(obj)) or not obj.__doc__:
                    continue
                answer = _summary(obj.__doc__)
                if 20 <= len(answer) <= 600:
                    kind = "class" if inspect.isclass(obj) else "function"
                    pairs.append((f"What does the {kind} {name}.{attr} do?", answer))
    return pairs


def build(out_dir: Path, seed: int = 0, heldout_fraction: float = 0.03) -> dict:
    """Write train.jsonl / heldout.jsonl (one {"text"} or {"messages"} per line) and a manifest."""
    rng = random.Random(seed)
    docs = [{"text": t} for t in doc_texts() if len(t) > 200]
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
             for q, a in docstring_pairs()]
    items = docs + chats
    rng.shuffle(items)
    n_held = max(8, int(len(items) * heldout_fraction))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("heldout", items[:n_held]), ("train", items[n_held:])):
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(it, ensure_ascii=False) + "\n" for it in part)
    manifest = {
        "sources": [str(DOC_SOURCES), f"Python {sys.version.split()[0]} standard library docstrings"],
        "licence": LICENCE,
        "documents": len(docs),
        "chat_pairs": len(chats),
        "heldout_items": n_held,
        "characters": sum(len(json.dumps(it)) for it in items),
        "seed": seed,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def bench_prompts(heldout: list[dict], per_kind: int = 4, seed: int = 0) -> list[dict]:
    """Held-out prompts of three task kinds: question answering (chat), prose continuation, code."""
    rng = random.Random(seed)
    chats = [it["messages"][0]["content"] for it in heldout if "messages" in it]
    docs = [it["text"] for it in heldout if "text" in it]
    out = [{"kind": "qa", "prompt": q, "raw": False} for q in rng.sample(chats, min(per_kind, len(chats)))]
    prose, code = [], []
    for text in docs:
        paras = [p for p in text.split("\n\n") if len(p) > 300]
        if paras:
            prose.append(paras[len(paras) // 2][:300])
        blocks = [p for p in text.split("\n\n") if p.lstrip().startswith(">>>") and len(p) > 120]
        if blocks:
            code.append(blocks[0][:200])
    out += [{"kind": "continuation", "prompt": p, "raw": True} for p in rng.sample(prose, min(per_kind, len(prose)))]
    out += [{"kind": "code", "prompt": c, "raw": True} for c in rng.sample(code, min(per_kind, len(code)))]
    return out
