"""Writes instructions.jsonl: arithmetic questions and their answers, one {"prompt", "response"}
a line, of many lengths. Run again to remake it: python make_instructions.py"""

from __future__ import annotations

import json
import random

WORDS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}


def records(count: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        terms = [rng.randint(0, 10 ** rng.randint(1, 3)) for _ in range(rng.randint(2, 4))]
        words = [rng.choice(list(WORDS)) for _ in terms[1:]]
        value = terms[0]
        for word, term in zip(words, terms[1:]):
            value = WORDS[word](value, term)
        question = " ".join([str(terms[0]), *(f"{w} {t}" for w, t in zip(words, terms[1:]))])
        made.append({"prompt": f"Question: what is {question}?\nAnswer:", "response": f" {value}.\n"})
    return made


if __name__ == "__main__":
    with open("instructions.jsonl", "w") as out:
        out.writelines(json.dumps(r) + "\n" for r in records(1024))
