"""Training and held-out prompts for distilling a draft of an instruct target.

Chats of the three kinds the project benchmarks (``specplugin/bench/instruct.py``):
**edit** (rewrite a function with one change: long copies), **explain** (a function or
docstring passage), **chat** (templated open questions: nothing to copy). Built from
stdlib modules the benchmark does not use (a test checks the lists), so no benchmark
prompt is trained on; held-out prompts use modules and chat topics training never sees.
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specplugin.bench.instruct import (EXPLAIN_LAYOUTS, Function, Limits, module_material,
                                       pick)

TRAIN_MODULES: tuple[str, ...] = (
    "abc.py", "aifc.py", "argparse.py", "ast.py", "asyncio/base_events.py",
    "asyncio/streams.py", "asyncio/tasks.py", "bdb.py", "bisect.py", "cgi.py", "chunk.py",
    "codecs.py", "collections/__init__.py", "contextlib.py", "copy.py", "copyreg.py",
    "csv.py", "dataclasses.py", "datetime.py", "dis.py", "doctest.py", "enum.py",
    "fileinput.py", "fnmatch.py", "ftplib.py", "functools.py", "gzip.py", "hashlib.py",
    "hmac.py", "html/parser.py", "http/client.py", "http/cookies.py", "http/server.py",
    "imaplib.py", "imghdr.py", "importlib/metadata/__init__.py", "inspect.py",
    "linecache.py", "locale.py", "logging/__init__.py", "logging/handlers.py",
    "mailbox.py", "mailcap.py", "modulefinder.py", "multiprocessing/connection.py",
    "multiprocessing/pool.py",
)
HELDOUT_MODULES: tuple[str, ...] = (
    "cmd.py", "code.py", "codeop.py", "filecmp.py", "getopt.py", "gettext.py",
    "graphlib.py", "ipaddress.py", "lzma.py", "mimetypes.py",
)
# about 300 tokens: an edited copy mostly ends within 256 tokens
LIMITS = Limits(min_lines=5, max_lines=40, max_function_chars=1100, min_passage_chars=250,
                max_passage_chars=1100)
KINDS = ("edit", "explain", "chat")
HELDOUT_TOPIC_EVERY = 6  # one chat topic in 6 is held out


@dataclass(frozen=True)
class Chat:
    kind: str  # one of KINDS
    content: str  # the user's turn

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.content}]


def read_material(modules: tuple[str, ...], root: Path | None = None
                  ) -> tuple[list[Function], list[tuple[str, str]]]:
    """Functions and (module, docstring passage) pairs of ``modules``, in file order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    missing = [m for m in modules if not (root / m).is_file()]
    if missing:
        raise FileNotFoundError(f"stdlib modules {', '.join(missing)} not found under {root}; "
                                "drop them from the recipe's module lists")
    parts = [module_material(root / m, m, LIMITS) for m in modules]
    return ([f for functions, _ in parts for f in functions],
            [p for _, passages in parts for p in passages])


# ---------------------------------------------------------------- edit and explain

NEW_NAMES = ("val", "obj", "res", "buf", "key_name", "arg", "tmp", "acc", "node", "piece",
             "elem", "cur", "out", "src", "dst", "name_", "number", "size_", "flag", "info")
REPLY = (
    "Return the full function.",
    "Output the complete modified code.",
    "Please show the entire function with the change applied.",
    "Print the whole function again, changed, in a code block.",
)
EDIT_LAYOUTS = (
    "{instruction} {reply}\n\n```python\n{code}```",
    "```python\n{code}```\n{instruction} {reply}",
    "I have this function from `{module}`:\n\n```python\n{code}```\n\nCan you {lower} {reply}",
    "Modify the code below. {instruction}\n\n```python\n{code}```",
)
EXPLAIN_CODE = (
    "Can you explain this function?",
    "What is the purpose of this code?",
    "Describe, step by step, what `{name}` does.",
    "Summarize what this function returns and when it raises an error.",
    "This comes from Python's `{module}` module. What does it do and why might it be useful?",
    "Explain this code to a beginner.",
)
EXPLAIN_TEXT = (
    "Rewrite this documentation in simpler terms.",
    "What does this documentation describe?",
    "Give a one-paragraph summary of this text.",
    "Explain the key points of this passage.",
)
def edit_instruction(function: Function, rng: np.random.Generator) -> str:
    """One change the function allows, phrased in one of a few ways."""
    changes = ["param"] * bool(function.params) + ["local"] * bool(function.local_names)
    changes += ["hints"] * (not function.annotated) + ["docstring"] * (not function.has_docstring)
    changes += ["function", "comments"]
    change = pick(changes, rng)
    words = set(re.findall(r"\w+", function.code))
    new = next((n for n in rng.permutation(NEW_NAMES) if n not in words), "renamed")
    if change in ("param", "local"):
        old = pick(function.params if change == "param" else function.local_names, rng)
        what = "parameter" if change == "param" else "variable"
        return pick((f"Change the name of the {what} `{old}` to `{new}`.",
                      f"Rename `{old}` to `{new}` throughout.",
                      f"Use `{new}` instead of `{old}` as the {what} name."), rng)
    return pick({
        "hints": ("Add type annotations to the parameters and the return type.",
                  "Annotate this function with type hints."),
        "docstring": ("Write a docstring for it.",
                      "Document the function with a short docstring."),
        "function": (f"Rename the function to `{function.name}_impl`.",
                     f"Call the function `new_{function.name.lstrip('_')}` instead."),
        "comments": ("Add a brief comment explaining the trickiest line.",
                     "Add comments that explain the main steps."),
    }[change], rng)


def edit_chat(function: Function, rng: np.random.Generator) -> Chat:
    instruction = edit_instruction(function, rng)
    lower = instruction[0].lower() + instruction[1:]
    return Chat("edit", pick(EDIT_LAYOUTS, rng).format(
        instruction=instruction, lower=lower, reply=pick(REPLY, rng), code=function.code,
        module=function.module))


def explain_chat(function: Function, rng: np.random.Generator) -> Chat:
    instruction = pick(EXPLAIN_CODE, rng).format(name=function.name, module=function.module)
    body = f"```python\n{function.code}```"
    return Chat("explain", pick(EXPLAIN_LAYOUTS, rng).format(instruction=instruction, body=body))


def explain_passage_chat(passage: tuple[str, str], rng: np.random.Generator) -> Chat:
    module, text = passage
    body = f"This is from the documentation of `{module}`:\n\n{text}"
    return Chat("explain", pick(EXPLAIN_LAYOUTS, rng).format(
        instruction=pick(EXPLAIN_TEXT, rng), body=body))


# ---------------------------------------------------------------- chat

# (templates, topics) per category: every template fits every topic of its category.
CHAT_CATEGORIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "science": (
        ("What is {}?", "Explain {} in simple terms.", "How does {} work?",
         "Why is {} important?", "Explain {} to a ten-year-old."),
        ("photosynthesis", "gravity", "a black hole", "plate tectonics", "DNA", "electricity",
         "magnetism", "the water cycle", "a volcano", "an earthquake", "ocean tides",
         "the greenhouse effect", "nuclear fusion", "natural selection", "the periodic table",
         "sound", "friction", "an atom", "the phases of the Moon", "ocean currents",
         "the human heart", "a solar eclipse", "erosion", "static electricity"),
    ),
    "technology": (
        ("What is {}?", "How does {} work?", "Explain {} like I am new to computers.",
         "What are the main uses of {}?"),
        ("cloud computing", "encryption", "a compiler", "a database", "GPS", "machine learning",
         "an operating system", "version control", "unit testing", "a CPU", "Wi-Fi",
         "a web browser", "open source software", "a search engine", "a password manager",
         "a spreadsheet", "Bluetooth", "a QR code"),
    ),
    "skills": (
        ("Give me some tips for {}.", "I want to get started with {}. Where do I begin?",
         "What are common mistakes people make when {}?", "How can I get better at {}?"),
        ("learning to play the guitar", "baking bread", "writing a resume", "public speaking",
         "growing herbs indoors", "meditation", "learning to swim", "studying for exams",
         "traveling on a budget", "taking photos with a phone", "keeping a journal",
         "hiking in the mountains", "managing stress", "drawing portraits", "knitting",
         "negotiating a salary", "making new friends in a new city", "cooking for one"),
    ),
    "writing": (
        ("Write a short poem about {}.", "Write a short story about {}.",
         "Describe {} in a few vivid sentences.", "Write a limerick about {}."),
        ("a lost umbrella", "a city at dawn", "an old library", "a snowy mountain",
         "a garden in spring", "a long train journey", "a paper boat", "a clockmaker",
         "a desert storm", "a talking tree", "a small bakery", "the first day of school",
         "a lighthouse in fog", "a forgotten key", "a kite on a windy day", "a quiet harbour"),
    ),
    "comparison": (
        ("Compare {} and {}.", "What are the main differences between {} and {}?",
         "Which would you recommend, {} or {}, and why?"),
        (("tea", "coffee"), ("trains", "planes"), ("Python", "JavaScript"),
         ("renting", "buying a home"), ("summer", "winter"), ("books", "films"),
         ("running", "cycling"), ("email", "phone calls"), ("laptops", "desktop computers"),
         ("printed maps", "GPS apps"), ("working alone", "working in a team"),
         ("SQL", "NoSQL databases")),
    ),
    "history": (
        ("Tell me about {}.", "Why was {} significant?", "Summarize the story of {}."),
        ("the printing press", "the Roman Empire", "the Industrial Revolution",
         "the invention of the telephone", "ancient Egypt", "the Renaissance",
         "the first Moon landing", "the Great Wall of China", "the Olympic Games",
         "the invention of paper", "the age of sail", "the first computers"),
    ),
    "python": (
        ("In Python, what does {} do?", "How do I use {} in Python? Give an example.",
         "When should I use {} in Python?"),
        ("a list comprehension", "a decorator", "a generator", "the with statement",
         "*args and **kwargs", "a lambda function", "an f-string", "a virtual environment",
         "a dictionary", "try and except", "a class", "the enumerate function",
         "the zip function", "a set", "slicing"),
    ),
}


def _topic_heldout(category: str, topic) -> bool:
    digest = hashlib.sha1(f"{category}:{topic}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELDOUT_TOPIC_EVERY == 0


def chat_questions(heldout: bool) -> list[str]:
    """Every template over every training (or held-out) topic, in a fixed order."""
    questions = []
    for category, (templates, topics) in CHAT_CATEGORIES.items():
        for topic in topics:
            if _topic_heldout(category, topic) != heldout:
                continue
            args = topic if isinstance(topic, tuple) else (topic,)
            questions.extend(t.format(*args) for t in templates)
    return questions


# ---------------------------------------------------------------- decks


def build_chats(modules: tuple[str, ...], counts: dict[str, int], heldout: bool, seed: int,
                root: Path | None = None) -> list[Chat]:
    """``counts[kind]`` chats of each kind, drawn without repeats while material lasts
    (then wrapping, with other phrasings), ordered edit, explain, chat."""
    rng = np.random.default_rng(seed)
    functions, passages = read_material(modules, root)
    questions = chat_questions(heldout)
    if not functions or not questions:
        raise ValueError(f"no functions in {', '.join(modules)} or no chat topics; "
                         "choose modules with functions of 5-40 lines")
    order_f, order_p = rng.permutation(len(functions)), rng.permutation(max(1, len(passages)))
    chats = [edit_chat(functions[order_f[i % len(functions)]], rng)
             for i in range(counts.get("edit", 0))]
    for i in range(counts.get("explain", 0)):  # one in three explains a docstring
        if passages and i % 3 == 2:
            chats.append(explain_passage_chat(passages[order_p[(i // 3) % len(passages)]], rng))
        else:  # the explain deck starts where the edit deck stopped
            chats.append(explain_chat(functions[order_f[(counts.get("edit", 0) + i)
                                                        % len(functions)]], rng))
    order_q = rng.permutation(len(questions))
    chats.extend(Chat("chat", questions[order_q[i % len(questions)]])
                 for i in range(counts.get("chat", 0)))
    return chats
