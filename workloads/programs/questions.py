"""The questions the SGLang frontend programs ask (GSM8K-style word problems, each with its
answer and three candidate answers: right, wrong, half-right) and the pasted background that
makes a long shared prefix. Pure data; ``sgl_frontend.py`` builds the programs on it."""

from __future__ import annotations

import random
from typing import NamedTuple


class Question(NamedTuple):
    text: str
    answer: str
    candidates: tuple[str, ...]  # for given_answers: right, wrong, half-right


QUESTIONS: tuple[Question, ...] = (
    Question(
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
        "clips in May. How many clips did Natalia sell altogether in April and May?",
        "72",
        ("48 + 24 = 72 clips.", "48 + 96 = 144 clips.", "About 70 clips."),
    ),
    Question(
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
        "babysitting. How much did she earn?",
        "10",
        ("12 / 60 * 50 = $10.", "12 * 50 = $600.", "A bit less than $12."),
    ),
    Question(
        "Betty is saving money for a new wallet which costs $100. Betty has only half of the "
        "money she needs. Her parents give her $15, and her grandparents twice as much as her "
        "parents. How much more money does Betty need to buy the wallet?",
        "5",
        ("100 - 50 - 15 - 30 = $5.", "100 - 50 - 15 = $35.", "She needs under $10 more."),
    ),
    Question(
        "James writes a 3-page letter to 2 different friends twice a week. How many pages "
        "does he write a year?",
        "624",
        ("3 * 2 * 2 * 52 = 624 pages.", "3 * 2 * 52 = 312 pages.", "Around 600 pages."),
    ),
    Question(
        "Albert buys 2 large pizzas and 2 small pizzas. A large pizza has 16 slices and a "
        "small pizza has 8 slices. If he eats it all, how many pieces does he eat that day?",
        "48",
        ("2 * 16 + 2 * 8 = 48 slices.", "16 + 8 = 24 slices.", "Roughly 50 slices."),
    ),
    Question(
        "Ken created a care package to send to his brother. He placed a box on a scale and "
        "poured in enough jelly beans to bring the weight to 2 pounds. Then he added enough "
        "brownies to cause the weight to triple. Next, he added another 2 pounds of jelly "
        "beans. Finally, he added enough gummy worms to double the weight once again. What "
        "was the final weight of the box of goodies, in pounds?",
        "16",
        ("((2 * 3) + 2) * 2 = 16 pounds.", "2 * 3 * 2 + 2 = 14 pounds.", "More than 10 lb."),
    ),
    Question(
        "Mark has a garden with flowers. He planted plants of three different colors in it. "
        "Ten of them are yellow, and there are 80% more of those in purple. There are only "
        "25% as many green flowers as there are yellow and purple flowers. How many flowers "
        "does Mark have in his garden?",
        "35",
        ("10 + 18 + 7 = 35 flowers.", "10 + 8 + 2 = 20 flowers.", "28 flowers, plus green."),
    ),
    Question(
        "Tina makes $18.00 an hour. If she works more than 8 hours per shift, she is eligible "
        "for overtime, which is paid by her hourly wage + 1/2 her hourly wage. If she works 10 "
        "hours every day for 5 days, how much money does she make?",
        "990",
        ("5 * (8 * 18 + 2 * 27) = $990.", "10 * 5 * 18 = $900.", "Between $900 and $1000."),
    ),
)

_FILLER = (
    "notes", "on", "the", "problem", "set", "from", "earlier", "sessions", "with", "remarks",
    "units", "rounding", "rates", "fractions", "percentages", "and", "common", "mistakes",
)  # fmt: skip


def question_for(seed: int) -> Question:
    return QUESTIONS[seed % len(QUESTIONS)]


def context_for(seed: int, num_words: int) -> str:
    """``num_words`` of pasted background before the question (a long shared prefix)."""
    if num_words == 0:
        return ""
    rng = random.Random(seed)
    return "Background: " + " ".join(rng.choice(_FILLER) for _ in range(num_words)) + "\n"
