"""MaskBench checks for one engine: compile a document's schema, then walk every test instance token by
token through the matcher (mask, accept), requiring termination on EOS. Promises: an instance counts
as accepted only if every token was accepted and EOS then terminated the matcher; whether every token
was also inside the mask (what generation would write) is reported beside it."""

from __future__ import annotations

import gzip
import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from radixlm.grammars import GrammarBackend, allocate_token_bitmask
from radixlm.grammars.base import CompiledGrammar
from radixlm.grammars.llguidance_backend import JSON_OPTIONS

ITEM_SEP, KEY_SEP = JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"]
ENGINES = ("ours", "ours_nonstrict", "xgrammar", "llguidance")


@dataclass
class Doc:
    source: str  # subset name, e.g. Github_easy, Glaiveai2K, BFCL
    name: str
    schema: Any
    tests: list[dict] = field(default_factory=list)


def subset_of(source: str) -> str:
    """Github_easy---o1234 → Github_easy; BFCL_simple_5 → BFCL; JME_13 → JME."""
    name = re.split(r"---|/", source)[0]
    return "BFCL" if name.startswith("BFCL") else re.sub(r"_\d+$", "", name)


def load_docs(path: str, limit: int | None = None) -> list[Doc]:
    """MaskBench documents ({"source", "doc": {schema, tests}}) or plain schemas ({"source", "schema"})."""
    docs = []
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        for line in f:
            row = json.loads(line)
            body = row.get("doc") or row
            docs.append(Doc(subset_of(row["source"]), row["source"], body["schema"], body.get("tests", [])))
            if limit is not None and len(docs) >= limit:
                break
    return docs


def instance_text(data: Any) -> str:
    """The instance in the one whitespace form every engine's grammar allows (", " and ": ")."""
    return json.dumps(data, ensure_ascii=False, separators=(ITEM_SEP, KEY_SEP))


def broken_keyword(schema: Any, data: Any) -> str:
    """The keyword jsonschema names for an invalid instance ('valid' if it finds none, 'error' if it fails)."""
    try:
        cls = jsonschema.validators.validator_for(schema)
        err = jsonschema.exceptions.best_match(
            cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(data)
        )
    except Exception:  # unresolvable refs, bad regexes: the label stays the dataset's
        return "error"
    return "valid" if err is None else str(err.validator)


class EngineRunner:
    """Compiles and walks for one engine name; masks are timed on valid instances only."""

    def __init__(self, backend: GrammarBackend, engine: str) -> None:
        self.backend = backend
        self.engine = engine
        self.tokenizer = backend.tokenizer
        self.eos = backend.stop_token_ids[0]
        self.bitmask = allocate_token_bitmask(1, backend.vocab_size)
        self.mask_us: list[float] = []

    def compile(self, schema: Any) -> CompiledGrammar:
        text = json.dumps(schema, ensure_ascii=False)
        if self.engine == "ours":
            return self.backend.compile("json_schema", text, "auto", strict=True)
        if self.engine == "ours_nonstrict":
            return self.backend.compile("json_schema", text, "auto", strict=False)
        if self.engine == "xgrammar":
            return self.backend.xgrammar.compile("json_schema", text)
        return self.backend.llguidance.compile("json_schema", text)

    def timed_compile(self, schema: Any) -> tuple[CompiledGrammar | None, float, str]:
        """(grammar or None, ms to compile and fill the first mask, error)."""
        t0 = time.perf_counter()
        try:
            grammar = self.compile(schema)
            grammar.new_matcher().fill_next_token_bitmask(self.bitmask, 0)
        except Exception as e:  # every engine's refusal, whatever its type, is a compile failure here
            return None, (time.perf_counter() - t0) * 1e3, f"{type(e).__name__}: {str(e)[:200]}"
        return grammar, (time.perf_counter() - t0) * 1e3, ""

    def accepts(self, grammar: CompiledGrammar, data: Any, time_masks: bool) -> tuple[bool, bool]:
        """(accepted, every token inside the mask): the grammar's language, and the generation mask
        (the same thing for single-grammar engines; llguidance via ours may prefer a narrower mask)."""
        ids = self.tokenizer.encode(instance_text(data), add_special_tokens=False)
        m = grammar.new_matcher()
        in_mask = True
        for tok in [*ids, self.eos]:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(self.bitmask, 0)
            if time_masks:
                self.mask_us.append((time.perf_counter() - t0) * 1e6)
            word = int(self.bitmask[0, tok // 32])
            in_mask = in_mask and bool((word >> (tok % 32)) & 1)
            if not m.accept_token(tok):
                return False, in_mask
        return m.is_terminated(), in_mask


class DocTimeout(Exception):
    """A document's compile and walks ran past the runner's limit."""


def _raise_timeout(*_: Any) -> None:
    raise DocTimeout()


def run_engine(
    runner: EngineRunner,
    docs: list[Doc],
    walk: bool = True,
    progress: Callable[[int], None] | None = None,
    doc_timeout_s: int = 0,
) -> Iterator[dict]:
    """One record per document: compile outcome and, when walked, each instance's verdict. With
    doc_timeout_s, a document still running after it counts as not compiled (checked whenever
    Python code runs, so a long call into an engine's native code ends first)."""
    if doc_timeout_s:
        signal.signal(signal.SIGALRM, _raise_timeout)
    for i, doc in enumerate(docs):
        signal.alarm(doc_timeout_s)
        try:
            rec = _run_doc(runner, doc, walk)
        except (DocTimeout, MemoryError) as e:  # counted as a schema the engine cannot take
            rec = {"source": doc.source, "name": doc.name, "compiled": False, "compile_ms": 0.0}
            why = f"over {doc_timeout_s} s" if isinstance(e, DocTimeout) else "out of memory"
            rec.update(error=f"{type(e).__name__}: {why}", instances=[])
        finally:
            signal.alarm(0)
        if progress is not None:
            progress(i)
        yield rec


def _run_doc(runner: EngineRunner, doc: Doc, walk: bool) -> dict:
    grammar, ms, err = runner.timed_compile(doc.schema)
    rec: dict[str, Any] = {
        "source": doc.source,
        "name": doc.name,
        "compiled": grammar is not None,
        "compile_ms": ms,
        "error": err,
        "instances": [],
    }
    if grammar is not None and walk:
        for t in doc.tests:
            ok, in_mask = runner.accepts(grammar, t["data"], time_masks=bool(t["valid"]))
            rec["instances"].append(
                {
                    "valid": bool(t["valid"]),
                    "accepted": ok,
                    "in_mask": in_mask,
                    "description": t.get("description", ""),
                }
            )
    if grammar is not None:
        rec["dropped"] = list(getattr(grammar, "dropped_keywords", []))
        rec["checked"] = list(getattr(grammar, "checked_keywords", []))
    return rec
