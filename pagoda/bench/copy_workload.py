"""A copy-heavy workload for speculative decoding: chat prompts asking the model to repeat a
passage, the case prompt lookup is made for (code edits, quoting, summaries that reuse text).

Each prompt is one of PASSAGES, so consecutive iterations share no prefix beyond the template
(the prefix cache cannot shorten their prefill). The passages are original text, written for
this benchmark.
"""

from __future__ import annotations

from typing import Any

INSTRUCTION = "Repeat the following text exactly, word for word, and nothing else:\n\n"

PASSAGES = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
    "wick, polished the great brass lens until it shone, and wrote the weather in a thick "
    "leather logbook. Ships passed safely along the rocky coast because of his small and "
    "patient work. In winter the storms shook the tower and salt spray froze on the windows, "
    "but the light never failed. When the keeper finally retired, the village gave him a "
    "clock, and he laughed, because he had never needed one to know when night was coming.",
    "A small bakery on the corner opens at five every morning. The baker mixes flour, water, "
    "salt and yeast in a wide wooden bowl, folds the dough gently, and lets it rest under a "
    "linen cloth. By seven the shelves are full of warm loaves, seeded rolls and sweet buns "
    "glazed with honey. Regular customers know each other by name and trade news while they "
    "wait in line. On rainy days the baker hands out free coffee, and nobody is ever in a "
    "hurry to leave the warm room that smells of bread and cinnamon.",
    "The river starts as a thin stream high in the mountains, fed by melting snow. It runs "
    "over smooth stones, through pine forests and past wooden bridges where hikers stop to "
    "rest. Lower down it grows wide and slow, turning the wheels of an old mill and watering "
    "fields of wheat and sunflowers. Herons wait in the shallows and children skip flat "
    "stones across its surface in summer. At last it reaches the sea, where fresh water and "
    "salt water meet in a wide delta full of birds, reeds and quiet channels.",
    "Every spring the town library holds a book fair in the central square. Volunteers carry "
    "tables out of the basement, sort donated books by subject and write prices on small "
    "paper labels. Students look for cheap textbooks, collectors search for rare first "
    "editions, and young children sit on blankets reading picture books aloud. The money "
    "raised pays for new chairs, better lamps and longer opening hours. By evening the "
    "tables are almost empty, and the librarians count the coins with tired but happy faces.",
)


def copy_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` chat prompts (token ids), each asking to repeat one passage, in turn."""
    return [
        chat_prompt_ids(tokenizer, INSTRUCTION + PASSAGES[i % len(PASSAGES)]) for i in range(count)
    ]


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """One user message in the tokenizer's chat template, ready for the answer: token ids."""
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
