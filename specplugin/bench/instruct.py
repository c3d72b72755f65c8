"""Instruct workloads: chat requests as a real instruct model's users send them.

One user turn per request, rendered through the target's chat template in the parent, so
every method gets the same ids. Kinds: **code-edit** (rewrite a function: long copies),
**explain** (a function or docstring: some copying), **chat** (nothing to copy);
``chat-mix`` mixes all three, half greedy. Requests stop at EOS, capped at ``max_tokens``.

Functions, docstrings (fixed stdlib modules) and questions are three decks shuffled by the
run's seed and dealt in :data:`DEAL_ORDER`, so headline cells never share material and a
cross-request proposer cannot replay an earlier cell. No vLLM import.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
import numpy as np

from specplugin.bench.chat_questions import QUESTIONS
from specplugin.bench.workloads import Cell, CellPrompts, grid, half_greedy, same_temperature

# paths under the stdlib root (missing ones are skipped): code a user might paste
STDLIB_MODULES: tuple[str, ...] = (
    "textwrap.py", "shlex.py", "fractions.py", "difflib.py", "calendar.py",
    "statistics.py", "heapq.py", "colorsys.py", "configparser.py", "glob.py",
    "posixpath.py", "json/encoder.py", "email/utils.py", "urllib/parse.py", "base64.py",
    "pprint.py",
)

Messages = list[dict[str, str]]  # one chat: [{"role": "user", "content": ...}]


@dataclass(frozen=True)
class Function:
    """A function of the stdlib, dedented, with what an edit instruction may name."""

    module: str  # dotted, e.g. "urllib.parse"
    name: str
    code: str  # ends with one newline
    params: tuple[str, ...]  # parameters an edit may rename (not self, cls)
    local_names: tuple[str, ...]  # names the body assigns
    has_docstring: bool
    annotated: bool  # any parameter or return annotation already


@dataclass(frozen=True)
class Limits:
    """Which functions and docstring passages of a module are material."""

    min_lines: int
    max_lines: int
    max_function_chars: int
    min_passage_chars: int
    max_passage_chars: int


# a function of <= ~300 tokens: an edited copy ends within code-edit's max_tokens
LIMITS = Limits(min_lines=8, max_lines=40, max_function_chars=1000, min_passage_chars=300,
                max_passage_chars=1200)


@dataclass(frozen=True)
class Material:
    """What prompts are made of: the three decks, each in a fixed order."""

    functions: tuple[Function, ...]
    texts: tuple[tuple[str, str], ...]  # (module, passage)
    questions: tuple[str, ...]

    def __post_init__(self):
        empty = [n for n in ("functions", "texts", "questions") if not getattr(self, n)]
        if empty:
            raise ValueError(f"no {' or '.join(empty)} for the instruct workloads; the "
                             f"stdlib modules {', '.join(STDLIB_MODULES)} were not found "
                             "under the stdlib root")


def _function(node: ast.FunctionDef, lines: Sequence[str], module: str,
              limits: Limits) -> Function | None:
    num_lines = node.end_lineno - node.lineno + 1
    if not limits.min_lines <= num_lines <= limits.max_lines or node.decorator_list:
        return None
    code = textwrap.dedent("".join(lines[node.lineno - 1: node.end_lineno])).rstrip() + "\n"
    if len(code) > limits.max_function_chars:
        return None
    args = node.args
    every_arg = [*args.posonlyargs, *args.args, *args.kwonlyargs,
                 *(a for a in (args.vararg, args.kwarg) if a)]
    params = tuple(a.arg for a in every_arg if a.arg not in ("self", "cls"))
    local_names = tuple(dict.fromkeys(
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        and n.id not in params))
    annotated = node.returns is not None or any(a.annotation for a in every_arg)
    return Function(module, node.name, code, params, local_names,
                    ast.get_docstring(node) is not None, annotated)


def _passage(docstring: str | None, limits: Limits) -> str | None:
    """The docstring's leading paragraphs up to the limit; None if too short."""
    text = ""
    for paragraph in (docstring or "").strip().split("\n\n"):
        if text and len(text) + 2 + len(paragraph) > limits.max_passage_chars:
            break
        text = f"{text}\n\n{paragraph}" if text else paragraph
    return text if limits.min_passage_chars <= len(text) <= limits.max_passage_chars else None


def module_material(path: Path, rel_path: str, limits: Limits
                    ) -> tuple[list[Function], list[tuple[str, str]]]:
    """The functions and (module, passage) pairs of one source file, in ``ast.walk`` order."""
    source = path.read_text(encoding="utf-8", errors="replace")
    module = rel_path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    lines = source.splitlines(keepends=True)
    functions, texts = [], []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
            passage = _passage(ast.get_docstring(node), limits)
            if passage:
                texts.append((module, passage))
        function = isinstance(node, ast.FunctionDef) and _function(node, lines, module, limits)
        if function:
            functions.append(function)
    return functions, texts


def material_from_stdlib(root: Path | None = None,
                         modules: Sequence[str] = STDLIB_MODULES) -> Material:
    """Functions and passages of ``modules`` under ``root`` (default: this Python's stdlib)."""
    import sysconfig

    root = Path(root or sysconfig.get_paths()["stdlib"])
    parts = [module_material(root / m, m, LIMITS) for m in modules if (root / m).is_file()]
    return Material(tuple(f for functions, _ in parts for f in functions),
                    tuple(t for _, texts in parts for t in texts), QUESTIONS)


# ---------------------------------------------------------------- requests

NEW_NAMES = ("value", "item", "result", "text", "count", "index", "data", "entry", "current",
             "items", "total", "parts", "source", "target", "output", "chunk", "line",
             "position", "element", "record")
REPLY_WHOLE = (
    "Reply with the whole updated function in a Python code block.",
    "Show the complete function after the change, in a ```python code block.",
    "Give me the full rewritten function in one code block.",
)
EDIT_LAYOUTS = (
    "{instruction} {reply}\n\n```python\n{code}```",
    "```python\n{code}```\n\n{instruction} {reply}",
    "Here is a function from Python's `{module}` module:\n\n```python\n{code}```\n\n"
    "{instruction} {reply}",
)
EXPLAIN_CODE = (
    "Explain what this code does.",
    "What does the following Python function do? Explain it step by step.",
    "Walk me through this function: what are its inputs, what does it return, and are "
    "there edge cases?",
    "I found this function in Python's `{module}` module. How does it work?",
)
EXPLAIN_TEXT = (
    "Explain this passage in plain words.",
    "Summarize the following documentation in a few sentences.",
    "What is this text about? Explain it to someone new to Python.",
)
EXPLAIN_LAYOUTS = ("{instruction}\n\n{body}", "{body}\n\n{instruction}")


def pick(options: Sequence[str], rng: np.random.Generator) -> str:
    return options[int(rng.integers(len(options)))]


def _edit_instruction(function: Function, rng: np.random.Generator) -> str:
    """One change the function allows: a rename, type hints, or a docstring."""
    edits = ["rename"] * bool(function.params or function.local_names)
    edits += ["type-hints"] * (not function.annotated)
    edits += ["docstring"] * (not function.has_docstring)
    edit = pick(edits or ["rename-function"], rng)
    if edit == "type-hints":
        return "Add type hints to its parameters and its return value."
    if edit == "docstring":
        return "Add a docstring that says what it does and what it returns."
    if edit == "rename-function":
        return f"Rename the function `{function.name}` to `{function.name}_v2`."
    old = pick(function.params or function.local_names, rng)
    what = "parameter" if old in function.params else "local variable"
    words = set(re.findall(r"\w+", function.code))
    new = next(n for n in [*rng.permutation(NEW_NAMES), f"{old}_new"] if n not in words)
    return f"Rename the {what} `{old}` to `{new}` everywhere in the function."


def code_edit_request(function: Function, rng: np.random.Generator) -> str:
    return pick(EDIT_LAYOUTS, rng).format(
        instruction=_edit_instruction(function, rng), reply=pick(REPLY_WHOLE, rng),
        code=function.code, module=function.module)


def explain_code_request(function: Function, rng: np.random.Generator) -> str:
    instruction = pick(EXPLAIN_CODE, rng).format(module=function.module)
    body = f"```python\n{function.code}```"
    return pick(EXPLAIN_LAYOUTS, rng).format(instruction=instruction, body=body)


def explain_text_request(text: tuple[str, str], rng: np.random.Generator) -> str:
    module, passage = text
    body = f"From the documentation of Python's `{module}` module:\n\n{passage}"
    return pick(EXPLAIN_LAYOUTS, rng).format(instruction=pick(EXPLAIN_TEXT, rng), body=body)


# ---------------------------------------------------------------- workloads and cells

CODE_EDIT, EXPLAIN, CHAT = "code-edit", "explain", "chat"
MIX_KINDS = (CODE_EDIT, EXPLAIN, CHAT)


@dataclass(frozen=True)
class InstructWorkload:
    name: str
    kinds: tuple[str, ...]  # request i asks kinds[i % len(kinds)]
    max_tokens: int  # a cap: requests stop at EOS
    batch_sizes: tuple[int, ...]
    temperatures: tuple[float, ...]
    # per-request temperatures from the cell's: (count, temperature) -> [count]
    request_temperatures: Callable[[int, float], list[float]] = same_temperature


# max_tokens fits a whole edited function (<= ~300 tokens) or a few paragraphs; requests
# that hit the cap are mostly greedy repetition loops, which a larger cap only lengthens
INSTRUCT_WORKLOADS: dict[str, InstructWorkload] = {
    w.name: w
    for w in (
        InstructWorkload(CODE_EDIT, (CODE_EDIT,), 384, (1, 8, 32), (0.0, 1.0)),
        InstructWorkload(EXPLAIN, (EXPLAIN,), 256, (1, 8, 32), (0.0, 1.0)),
        InstructWorkload(CHAT, (CHAT,), 256, (1, 8, 32), (0.0, 1.0)),
        InstructWorkload("chat-mix", MIX_KINDS, 384, (8, 32), (1.0,), half_greedy),
    )
}

# each kind greedy at b1, chat sampled at b1, copying batched, a server's mix at b8 and b32
INSTRUCT_HEADLINE = (Cell(CODE_EDIT, 1, 0.0), Cell(EXPLAIN, 1, 0.0), Cell(CHAT, 1, 0.0),
                     Cell(CHAT, 1, 1.0), Cell(CODE_EDIT, 8, 0.0), Cell("chat-mix", 8, 1.0),
                     Cell("chat-mix", 32, 1.0))
INSTRUCT_QUICK = (Cell(CODE_EDIT, 1, 0.0), Cell("chat-mix", 8, 1.0))


@dataclass(frozen=True)
class InstructSizes:
    """Requests per cell, and (``--quick``) a cap on every workload's max_tokens."""

    min_requests: int  # per cell; batch 1 runs this many requests one after the other
    max_tokens_cap: int | None = None

    def num_batches(self, batch_size: int) -> int:
        return max(1, -(-self.min_requests // batch_size))

    def max_tokens(self, workload: str) -> int:
        cap = INSTRUCT_WORKLOADS[workload].max_tokens
        return cap if self.max_tokens_cap is None else min(cap, self.max_tokens_cap)


INSTRUCT_SIZES = InstructSizes(min_requests=6)
INSTRUCT_QUICK_SIZES = InstructSizes(min_requests=2, max_tokens_cap=96)


# the order in which cells take their hands of the decks
DEAL_ORDER = INSTRUCT_HEADLINE + tuple(c for c in grid(INSTRUCT_WORKLOADS)
                                       if c not in INSTRUCT_HEADLINE)


def request_kinds(cell: Cell, sizes: InstructSizes) -> list[str]:
    kinds = INSTRUCT_WORKLOADS[cell.workload].kinds
    count = sizes.num_batches(cell.batch_size) * cell.batch_size
    return [kinds[i % len(kinds)] for i in range(count)]


def _demand(kinds: Sequence[str]) -> Counter:
    """Cards each deck deals for these requests (explain alternates code and text)."""
    num_explain = kinds.count(EXPLAIN)
    return Counter({"functions": kinds.count(CODE_EDIT) + (num_explain + 1) // 2,
                    "texts": num_explain // 2, "questions": kinds.count(CHAT)})


def _offsets(cell: Cell, sizes: InstructSizes) -> Counter:
    """Cards dealt before ``cell`` in :data:`DEAL_ORDER` (all, for a cell not in it)."""
    before = DEAL_ORDER[: DEAL_ORDER.index(cell)] if cell in DEAL_ORDER else DEAL_ORDER
    total: Counter = Counter()
    for other in before:
        total.update(_demand(request_kinds(other, sizes)))
    return total


def cell_messages(material: Material, sizes: InstructSizes, cell: Cell,
                  base_seed: int = 0) -> list[Messages]:
    """The cell's chats, one user turn each, in request order."""
    kinds = request_kinds(cell, sizes)
    offsets = _offsets(cell, sizes)
    decks = {name: np.random.default_rng(base_seed).permutation(len(getattr(material, name)))
             for name in ("functions", "texts", "questions")}
    dealt: Counter = Counter()

    def deal(name: str):
        deck = decks[name]
        index = deck[(offsets[name] + dealt[name]) % len(deck)]
        dealt[name] += 1
        return getattr(material, name)[index]

    rng = np.random.default_rng(cell.seed(base_seed))
    chats, num_explain = [], 0
    for kind in kinds:
        if kind == CODE_EDIT:
            content = code_edit_request(deal("functions"), rng)
        elif kind == EXPLAIN:
            content = (explain_code_request(deal("functions"), rng) if num_explain % 2 == 0
                       else explain_text_request(deal("texts"), rng))
            num_explain += 1
        else:
            content = deal("questions")
        chats.append([{"role": "user", "content": content}])
    return chats


@dataclass(frozen=True)
class InstructSource:
    """The material and the target's chat template, as a function of a chat to token ids."""

    material: Material
    render: Callable[[Messages], list[int]]


def cell_prompts(source: InstructSource, sizes: InstructSizes, cell: Cell,
                 base_seed: int = 0) -> CellPrompts:
    workload = INSTRUCT_WORKLOADS[cell.workload]
    prompts = [source.render(m) for m in cell_messages(source.material, sizes, cell, base_seed)]
    temperatures = tuple(workload.request_temperatures(len(prompts), cell.temperature))
    return CellPrompts(cell, tuple(tuple(int(t) for t in p) for p in prompts),
                       sizes.max_tokens(cell.workload),
                       None if set(temperatures) == {cell.temperature} else temperatures,
                       ignore_eos=False)


# ---------------------------------------------------------------- the target's template


def chat_renderer(tokenizer) -> Callable[[Messages], list[int]]:
    """A chat as token ids through ``tokenizer``'s chat template, with generation prompt."""
    def render(messages: Messages) -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return [int(i) for i in ids]

    return render


def has_chat_template(folder: Path) -> bool:
    """Whether the tokenizer saved in ``folder`` has a chat template."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def source_from_folder(target: Path, stdlib_root: Path | None = None) -> InstructSource:
    """The stdlib material and the chat template of the tokenizer in ``target``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    return InstructSource(material_from_stdlib(stdlib_root), chat_renderer(tokenizer))

