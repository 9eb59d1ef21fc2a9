"""Benchmark prompts: the start of held-out windows of the demo corpus (files no model trained on),
held-out chat turns for a chat target, or plain deterministic ids where any ids will do (replayed drafts,
load tests)."""

from __future__ import annotations

from pathlib import Path


def id_prompts(vocab_size: int, count: int, length: int) -> list[tuple[int, ...]]:
    """`count` deterministic prompts of `length` ordinary ids (clear of the low special ids), different
    per prompt."""
    span = vocab_size - 10
    return [tuple((7 + 31 * p + 17 * i) % span + 5 for i in range(length)) for p in range(count)]


def heldout_prompts(target_dir: Path, count: int, tokens: int) -> tuple[tuple[int, ...], ...]:
    """`count` prompts of `tokens` ids, in the target's tokenizer. Raises ValueError when the
    held-out files are too short for that many."""
    from transformers import AutoTokenizer

    from draftwire_cli.models.demopair.corpus import WINDOW, heldout_windows

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    windows = heldout_windows(tokenizer, count, max(tokens, WINDOW))
    if len(windows) < count:
        raise ValueError(f"held-out files give {len(windows)} windows, not {count}")
    return tuple(tuple(w[:tokens]) for w in windows)


def chat_prompts(target_dir: Path, count: int) -> tuple[tuple[int, ...], ...]:
    """`count` held-out chat turns (the SmolLM2 card's questions) rendered with the target's chat
    template, generation prompt included. Raises ValueError when there are fewer than that."""
    from draftwire_cli.models.smollm2_card import CARD_PROMPTS

    if count > len(CARD_PROMPTS):
        raise ValueError(f"{len(CARD_PROMPTS)} held-out chat prompts, not {count}")
    return chat_turns(target_dir, CARD_PROMPTS[:count])


def chat_turns(target_dir: Path, questions) -> tuple[tuple[int, ...], ...]:
    """Each question as one user turn rendered with the target's chat template, generation prompt
    included."""
    from transformers import AutoTokenizer

    from draftwire_cli.models.fromgguf import chat_ids

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return tuple(tuple(chat_ids(tokenizer, q)) for q in questions)


# Held-out code turns, written for these benchmarks (nothing was tuned on them), in three kinds: write a
# function from a description; complete a given snippet; rewrite given code (rename, annotate, fix,
# restructure), where most of the answer repeats the prompt: the case prompt lookup (n-gram drafting)
# is for. Fixed text, no download.
CODE_PROMPTS = (
    # Write a function.
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that counts how many times each word occurs in a string and returns a dict.",
    "Write a JavaScript function that removes duplicate values from an array, keeping the first of each.",
    "Write a Python function that merges two sorted lists into one sorted list without calling sort.",
    "Write a C function that reverses a null-terminated string in place.",
    # Complete a snippet.
    "Complete this Python function:\n\n```python\ndef is_prime(n: int) -> bool:\n"
    '    """True when n is a prime number."""\n    if n < 2:\n        return False\n```',
    "Complete this Python class so that it works as a stack with push, pop and peek:\n\n```python\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n```",
    "Finish this function, which should return the average of the numbers in a list, or None for an "
    "empty list:\n\n```python\ndef average(values):\n    if not values:\n```",
    # Rewrite given code: the answer repeats most of the prompt.
    "Rename the variable `x` to `total` everywhere in this code:\n\n```python\ndef add_prices(items):\n"
    "    x = 0\n    for item in items:\n        x = x + item.price * item.quantity\n"
    "    if x > 100:\n        x = x * 0.9\n    return x\n```",
    "Add type hints to this Python function:\n\n```python\ndef greet(name, times):\n    lines = []\n"
    "    for i in range(times):\n        lines.append('Hello, ' + name + '!')\n"
    "    return '\\n'.join(lines)\n```",
    "Rewrite this loop as a list comprehension:\n\n```python\nsquares = []\nfor number in range(20):\n"
    "    if number % 2 == 0:\n        squares.append(number * number)\n```",
    "Fix the bug in this function, which should return the largest value in a list:\n\n```python\n"
    "def largest(values):\n    best = values[0]\n    for value in values:\n        if value < best:\n"
    "            best = value\n    return best\n```",
    "Add a docstring to each function in this code:\n\n```python\ndef area(width, height):\n"
    "    return width * height\n\n\ndef perimeter(width, height):\n    return 2 * (width + height)\n```",
    "Convert this Python code to use f-strings:\n\n```python\nname = 'Ada'\nage = 36\n"
    "print('Name: ' + name)\nprint('Age: ' + str(age))\nprint('Next year ' + name + ' will be ' "
    "+ str(age + 1))\n```",
    "Rewrite this JavaScript to use const and arrow functions:\n\n```javascript\n"
    "var numbers = [1, 2, 3, 4];\n"
    "var doubled = numbers.map(function (n) {\n  return n * 2;\n});\n"
    "var total = doubled.reduce(function (sum, n) {\n  return sum + n;\n}, 0);\nconsole.log(total);\n```",
    "Change this SQL query so that it also returns the customer's email, sorted by name:\n\n```sql\n"
    "SELECT customers.name, orders.total\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n"
    "WHERE orders.total > 50;\n```",
)

# The kind of each code prompt, in order.
CODE_PROMPT_KINDS = ("write",) * 5 + ("complete",) * 3 + ("rewrite",) * 8
assert len(CODE_PROMPT_KINDS) == len(CODE_PROMPTS)

# Held-out short verse, written for these benchmarks: the prompt class where a small draft agrees least
# with its target (0.50 greedy agreement on a haiku for the Qwen pair, issue 29, against 0.92 on code).
HAIKU_PROMPTS = (
    "Write a haiku about a lighthouse in fog.",
    "Write a haiku about the first snow on a city street.",
    "Write a haiku about a cat asleep in a patch of sun.",
    "Write a haiku about a train leaving at midnight.",
    "Write a haiku about an old bridge over a river.",
    "Write a haiku about the smell of rain on hot stone.",
)

PROMPT_SETS = ("chat", "code", "haiku")


def code_prompts(target_dir: Path, count: int) -> tuple[tuple[int, ...], ...]:
    """`count` held-out code turns (CODE_PROMPTS) rendered with the target's chat template, generation
    prompt included. Raises ValueError when there are fewer than that."""
    if count > len(CODE_PROMPTS):
        raise ValueError(f"{len(CODE_PROMPTS)} held-out code prompts, not {count}")
    return chat_turns(target_dir, CODE_PROMPTS[:count])


def prompt_set(name: str, target_dir: Path, count: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The held-out chat turns ('chat', 24), code turns ('code', 16) or verse turns ('haiku', 6) for a
    chat target, rendered with its template: the first `count`, all of them when None. Raises
    ValueError for another name, or a count past the set's."""
    from draftwire_cli.models.smollm2_card import CARD_PROMPTS

    texts = {"chat": CARD_PROMPTS, "code": CODE_PROMPTS, "haiku": HAIKU_PROMPTS}
    if name not in texts:
        raise ValueError(f"prompt set {name!r}: one of {', '.join(PROMPT_SETS)}")
    count = len(texts[name]) if count is None else count
    if count > len(texts[name]):
        raise ValueError(f"{len(texts[name])} held-out {name} prompts, not {count}")
    return chat_turns(target_dir, texts[name][:count])
