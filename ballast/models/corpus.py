"""In-memory training text for the offline tiny tokenizer.

The tokenizer is trained on this text in well under a second, so its merges must come from text
written here (no downloads). It mixes plain English, numbers and arithmetic (GSM8K-style word
problems), chat-role words, and the phrasing of Ballast's synthetic "repeat" task so that task
prompts tokenize into few tokens.

One rule matters for the synthetic task and is checked by the tests: no two task symbols
(`TASK_SYMBOLS`) are ever adjacent in this text. BPE can then never learn a merge made only of task
symbols, so a response of K copies of a symbol is exactly K tokens, whatever pre-tokenizer loads the
tokenizer. That keeps the ideal response lengths (in tokens) as long-tailed as the task's counts.
"""

from __future__ import annotations

import random

# Symbols the synthetic task may ask the model to repeat. Kept in sync with
# ballast.data.synthetic.DEFAULT_SYMBOLS by a test (the packages do not import each other).
TASK_SYMBOLS = "#*@%+=~^"

_ENGLISH = """\
The small model reads a prompt and writes an answer one token at a time.
A good answer is short, clear and correct. A bad answer is long and wanders.
Every morning the baker opens the shop at six and sells fresh bread until noon.
She bought three apples, two pears and a bag of oranges at the market.
The train leaves the station at half past nine and arrives two hours later.
When it rains, the children play inside and read books about ships and stars.
He walked to the river, sat under a tree and watched the boats go by.
Our team finished the project a week early because everyone helped.
The teacher asked the class to count the chairs in the room.
If you have five coins and find seven more, you have twelve coins in total.
Water boils at one hundred degrees and freezes at zero degrees.
The garden has rows of tomatoes, beans, carrots and a few tall sunflowers.
Please write your final answer on the last line of your reply.
Let us think step by step before we give the answer.
The farmer sold half of his eggs in the morning and a third of the rest at night.
How many pages does she read each day if she finishes the book in a week?
They paid ten dollars for the tickets and four dollars for snacks.
The library is open from Monday to Saturday, and it is closed on Sunday.
A square has four equal sides; a triangle has three sides.
The store sells pencils in packs of twelve and erasers in packs of six.
Each student needs two notebooks, one ruler and a box of colored pencils.
It took them forty minutes to walk there and thirty minutes to walk back.
The price went up by twenty percent, so the new price is higher than before.
What is the total cost of the trip if each person pays the same amount?
The user asks a question, the assistant answers it, and the system sets the rules.
You are a helpful assistant. Answer the question and stop when you are done.
Repeat after me, and do not add anything else to the reply.
The answer is a number. Write only the number after the marks at the end.
Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 10 appear in many questions.
"""

_NAMES = ["Ana", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas"]
_ITEMS = ["apples", "books", "coins", "cookies", "marbles", "pencils", "stamps", "tickets"]


def _arithmetic_lines(rng: random.Random, num_lines: int) -> list[str]:
    """Word problems with worked answers, so digits, operators and money words get merges."""
    lines = []
    for _ in range(num_lines):
        name = rng.choice(_NAMES)
        item = rng.choice(_ITEMS)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        if rng.random() < 0.5:
            lines.append(
                f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now? "
                f"{a} + {b} = {a + b}. The answer is {a + b}."
            )
        else:
            lines.append(
                f"{name} buys {a} boxes with {b} {item} in each box. "
                f"That is {a} * {b} = {a * b} {item}, which costs ${a * b}.00 in total."
            )
    return lines


def _task_lines(rng: random.Random, num_lines: int) -> list[str]:
    """Phrasings of the synthetic repeat task; symbols always stand alone (see module docstring)."""
    lines = []
    for _ in range(num_lines):
        symbol = rng.choice(TASK_SYMBOLS)
        count = rng.randint(1, 300)
        lines.append(f"Repeat the symbol {symbol} exactly {count} times.")
    return lines


def training_corpus(seed: int = 0) -> list[str]:
    """The tokenizer's training text as a list of lines (deterministic for a given seed)."""
    rng = random.Random(seed)
    lines = [line for line in _ENGLISH.splitlines() if line]
    lines += _arithmetic_lines(rng, 300)
    lines += _task_lines(rng, 200)
    lines += [f"{role}: {line}" for role in ("system", "user", "assistant") for line in lines[:20]]
    return lines
