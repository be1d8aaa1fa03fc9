"""Tasks: prompts, references and a score, from a ``datasets`` name, a local path, or the embedded default.

Names (need the Hugging Face hub): ``gsm8k``, ``xsum``, ``cnn_dailymail``, ``wmt14`` (de-en, En->De as in
the paper), ``lm1b``. Local paths: a folder with ``train.jsonl``/``test.jsonl`` (``question``/``answer`` or
``prompt``/``reference`` lines), a folder with ``train.{en,de}.gz`` parallel text (Multi30k layout), or a
plain-text file / a folder with ``input.txt`` (language modelling). ``arith`` is the embedded default:
GSM8K-style word problems generated from a seed, so a fresh machine needs no download.
"""

from __future__ import annotations

import gzip
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from distillspec.errors import DistillSpecError
from distillspec.models import hub

HUB_TASKS = ("gsm8k", "xsum", "cnn_dailymail", "wmt14", "lm1b")


@dataclass
class Example:
    prompt: str  #: the task's own prompt format ("Question: ...\nAnswer:")
    reference: str  #: what follows the prompt (" <answer>")
    message: str | None = None  #: the prompt as a chat model's user message (None: running text, no chat form)


@dataclass
class Task:
    name: str
    train: list[Example]
    test: list[Example]
    metric: str | None  #: "accuracy" | "bleu" | "rouge" | None (language modelling)


# ---------------------------------------------------------------------------------------------- formats


def qa_example(question: str, answer: str) -> Example:
    return Example(f"Question: {question.strip()}\nAnswer:", " " + answer.strip(), question.strip())


def translation_example(source: str, target: str) -> Example:
    message = f"Translate into German: {source.strip()}"
    return Example(f"English: {source.strip()}\nGerman:", " " + target.strip(), message)


def summary_example(document: str, summary: str, max_chars: int = 1500) -> Example:
    document = document.strip()[:max_chars]
    return Example(f"Document: {document}\nSummary:", " " + summary.strip(), f"Summarize in one sentence: {document}")


def lm_examples(text: str, chunk_chars: int = 400, prompt_chars: int = 100) -> list[Example]:
    """Cut running text into chunks at line breaks; the first ``prompt_chars`` of each is the prompt."""
    chunks, start = [], 0
    while start < len(text):
        end = text.find("\n", start + chunk_chars)
        end = len(text) if end < 0 else end
        chunk = text[start:end].strip()
        if len(chunk) > prompt_chars:
            cut = chunk.rfind(" ", 0, prompt_chars)
            cut = prompt_chars if cut <= 0 else cut
            chunks.append(Example(chunk[:cut], chunk[cut:]))
        start = end + 1
    return chunks


# ---------------------------------------------------------------------------------------------- embedded


_NAMES = ["Mia", "Leo", "Ava", "Noah", "Emma", "Liam", "Zoe", "Omar", "Lily", "Ben", "Sara", "Ivan"]
_ITEMS = ["apples", "books", "stamps", "marbles", "cards", "shells", "pens", "coins", "eggs", "stickers"]


def arith_example(rng: random.Random) -> Example:
    """A two-step word problem with a worked answer ending in '#### N' (GSM8K format)."""
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    gain = rng.choice(["buys", "finds", "gets", "wins"])
    s1 = a + b
    if rng.random() < 0.5:
        c = rng.randint(1, s1)
        loss = rng.choice(["gives", "sells", "loses"])
        tail = f"gives {c} to {other}" if loss == "gives" else f"{loss} {c} of them"
        question = (
            f"{name} has {a} {item}. {name} {gain} {b} more and then {tail}. How many {item} does {name} have now?"
        )
        res, op2 = s1 - c, f"{s1} - {c}"
    else:
        c = rng.randint(2, 5)
        question = (
            f"{name} has {a} {item} and {gain} {b} more. {other} has {c} times as many {item} as {name}. "
            f"How many {item} does {other} have?"
        )
        res, op2 = s1 * c, f"{s1} * {c}"
    first = rng.choice(
        [
            f"{name} has {a} + {b} = {s1} {item}.",
            f"First, {a} + {b} = {s1}.",
            f"{name} now has {a} + {b} = {s1} {item}.",
        ]
    )
    second = rng.choice([f"Then {op2} = {res}.", f"So the answer is {op2} = {res}.", f"Next, {op2} = {res} {item}."])
    return qa_example(question, f"{first} {second}\n#### {res}")


def arith_task(n_train: int = 20000, n_test: int = 500, seed: int = 0) -> Task:
    rng = random.Random(seed)
    examples = [arith_example(rng) for _ in range(n_train + n_test)]
    return Task("arith", examples[:n_train], examples[n_train:], "accuracy")


# ---------------------------------------------------------------------------------------------- loading


def _read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _jsonl_examples(rows: list[dict], path: Path) -> list[Example]:
    if rows and {"question", "answer"} <= rows[0].keys():
        return [qa_example(r["question"], r["answer"]) for r in rows]
    if rows and {"prompt", "reference"} <= rows[0].keys():
        return [Example(r["prompt"], r["reference"], r["prompt"].strip()) for r in rows]
    raise DistillSpecError(f"{path}: each line needs 'question'/'answer' or 'prompt'/'reference' keys")


def _read_lines_gz(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def _parallel(folder: Path, split: str, src: str = "en", tgt: str = "de") -> list[Example]:
    for suffix in (".gz", ""):
        s, t = folder / f"{split}.{src}{suffix}", folder / f"{split}.{tgt}{suffix}"
        if s.exists() and t.exists():
            src_lines, tgt_lines = _read_lines_gz(s), _read_lines_gz(t)
            if len(src_lines) != len(tgt_lines):
                raise DistillSpecError(f"{s} has {len(src_lines)} lines but {t} has {len(tgt_lines)}")
            return [translation_example(a, b) for a, b in zip(src_lines, tgt_lines) if a.strip() and b.strip()]
    return []


def load_local(path: Path) -> Task:
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        return _split_lm(path.stem, text)
    if (path / "train.jsonl").exists():
        train = _jsonl_examples(_read_jsonl(path / "train.jsonl"), path / "train.jsonl")
        test_file = next(
            (path / f for f in ("test.jsonl", "validation.jsonl", "val.jsonl") if (path / f).exists()), None
        )
        test = _jsonl_examples(_read_jsonl(test_file), test_file) if test_file else []
        metric = "accuracy" if train and "####" in train[0].reference else "rouge"
        return Task(path.name, train, test, metric)
    if _parallel(path, "train"):
        test = _parallel(path, "test_2016_flickr") or _parallel(path, "test") or _parallel(path, "val")
        return Task(path.name, _parallel(path, "train"), test, "bleu")
    if (path / "input.txt").exists():
        return _split_lm(path.name, (path / "input.txt").read_text(encoding="utf-8"))
    raise DistillSpecError(
        f"dataset path {str(path)!r}: expected train.jsonl, train.{{en,de}}[.gz], input.txt or a text file"
    )


def _split_lm(name: str, text: str) -> Task:
    examples = lm_examples(text)
    n_test = max(1, len(examples) // 20)
    return Task(name, examples[:-n_test], examples[-n_test:], None)


def load_hub(name: str) -> Task:
    """Load a task through ``datasets`` (needs the Hugging Face hub or its local cache)."""
    hub.require(name, "dataset")  # fail at once when it cannot be had (no retries)
    import datasets  # noqa: PLC0415 (0.4 s of import that local and embedded tasks, and every actor, do without)

    try:
        if name == "gsm8k":
            ds = datasets.load_dataset("gsm8k", "main")
            conv, metric, test = (lambda r: qa_example(r["question"], r["answer"])), "accuracy", "test"
        elif name == "xsum":
            ds = datasets.load_dataset("xsum")
            conv, metric, test = (lambda r: summary_example(r["document"], r["summary"])), "rouge", "test"
        elif name == "cnn_dailymail":
            ds = datasets.load_dataset("cnn_dailymail", "3.0.0")
            conv, metric, test = (lambda r: summary_example(r["article"], r["highlights"])), "rouge", "test"
        elif name == "wmt14":
            ds = datasets.load_dataset("wmt14", "de-en")
            conv = lambda r: translation_example(r["translation"]["en"], r["translation"]["de"])
            metric, test = "bleu", "test"
        else:  # lm1b
            ds = datasets.load_dataset("lm1b")
            conv, metric, test = (lambda r: Example(*_split_sentence(r["text"]))), None, "test"
    except Exception as exc:  # offline, unknown config, ...: one line naming the way out
        raise DistillSpecError(
            f"dataset {name!r} could not be loaded from the Hugging Face hub ({type(exc).__name__}: {str(exc)[:200]}); "
            "without the hub, pass a local path (e.g. ../shared/data/gsm8k) or the embedded default 'arith'"
        ) from None
    return Task(name, [conv(r) for r in ds["train"]], [conv(r) for r in ds[test]], metric)


def _split_sentence(text: str) -> tuple[str, str]:
    words = text.split()
    k = max(1, len(words) // 3)
    return " ".join(words[:k]), " " + " ".join(words[k:])


def chat_task(task: Task, tokenizer) -> Task:
    """``task`` with each prompt written through ``tokenizer``'s chat template: the example's message as the user's
    turn, then the assistant's turn begun (the reference follows it without its leading space). Examples with no
    message (running text) keep their prompt."""

    def render(e: Example) -> Example:
        if e.message is None:
            return e
        turn = [{"role": "user", "content": e.message}]
        prompt = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        return Example(prompt, e.reference.lstrip(), e.message)

    return Task(task.name, [render(e) for e in task.train], [render(e) for e in task.test], task.metric)


CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ PREFIX + (m['content'] | trim) + SUFFIX }}"
    "{%- elif m['role'] == 'assistant' -%}{{ ' ' + (m['content'] | trim) + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def chat_template(task: Task) -> str | None:
    """A chat template in ``task``'s prompt format when its prompts read ``"<Label>: <content>\n<Label>:"`` (QA,
    translation, summaries), else None (a chat request then gets a 400)."""
    prompt = task.train[0].prompt if task.train else ""
    m = re.fullmatch(r"(\w+: ).*(\n\w+:)", prompt, flags=re.DOTALL)
    if m is None:
        return None
    return CHAT_TEMPLATE.replace("PREFIX", json.dumps(m.group(1))).replace("SUFFIX", json.dumps(m.group(2)))


def chat_prompts(task: Task, tokenizer, enabled: bool = True) -> Task:
    """The task as a model with ``tokenizer`` is prompted (``enabled``: the ``chat_template`` key): through its chat
    template when it has one (:func:`chat_task`), except a garden tokenizer's, which writes the task's own prompt
    format already; else ``task`` itself."""

    template = getattr(tokenizer, "chat_template", None)
    if not enabled or not template or template == chat_template(task):
        return task
    return chat_task(task, tokenizer)


def load_task(spec: str, *, seed: int = 0) -> Task:
    """Resolve ``spec`` (``arith``, a hub task name, or a local path) to a non-empty :class:`Task`."""
    if spec == "arith":
        task = arith_task(seed=seed)
    elif Path(spec).expanduser().exists():
        task = load_local(Path(spec).expanduser())
    elif spec in HUB_TASKS:
        task = load_hub(spec)
    elif "/" in spec or spec.startswith("."):
        raise DistillSpecError(f"dataset path {spec!r} does not exist")
    else:
        raise DistillSpecError(f"dataset={spec!r}: use 'arith', one of {list(HUB_TASKS)}, or a local path")
    if not task.train:
        raise DistillSpecError(f"dataset {spec!r} has no training examples: it is empty or in an unknown layout")
    if not task.test:  # hold out 5% for measuring (a one-example set is measured on itself)
        n = max(1, len(task.train) // 20)
        task.train, task.test = (task.train[:-n], task.train[-n:]) if len(task.train) > 1 else (task.train, task.train)
    return task
