"""Workloads for speculative decoding with a draft model, where its users are: code completion
and chat.

code: a Python function's signature and docstring, as an editor sends it for completion (plain
text, no chat template: the model continues the file with the body). chat: a user's question in
the model's chat template. Both are original text, written for this benchmark; each prompt is a
different one, so consecutive iterations share no prefix the prefix cache could skip.
"""

from __future__ import annotations

from typing import Any

from pagoda.bench.copy_workload import chat_prompt_ids

CODE = (
    ("def median(values: list[float]) -> float:", "Return the median of a non-empty list."),
    (
        "def is_palindrome(text: str) -> bool:",
        "True if text reads the same backwards, ignoring case and spaces.",
    ),
    (
        "def word_counts(text: str) -> dict[str, int]:",
        "Count each lower-cased word of text, splitting on whitespace.",
    ),
    ("def flatten(nested: list[list[int]]) -> list[int]:", "Concatenate the inner lists in order."),
    (
        "def chunks(items: list[int], size: int) -> list[list[int]]:",
        "Split items into consecutive lists of at most size items.",
    ),
    ("def fibonacci(n: int) -> list[int]:", "Return the first n Fibonacci numbers, starting 0, 1."),
    (
        "def is_prime(n: int) -> bool:",
        "True if n is a prime number, by trial division up to its square root.",
    ),
    (
        "def gcd(a: int, b: int) -> int:",
        "Greatest common divisor of a and b with Euclid's algorithm.",
    ),
    (
        "def binary_search(items: list[int], target: int) -> int:",
        "Index of target in the sorted list items, or -1 if it is absent.",
    ),
    (
        "def merge_sorted(a: list[int], b: list[int]) -> list[int]:",
        "Merge two sorted lists into one sorted list.",
    ),
    (
        "def transpose(matrix: list[list[float]]) -> list[list[float]]:",
        "Return the transpose of a rectangular matrix.",
    ),
    (
        "def parse_csv_line(line: str) -> list[str]:",
        "Split one CSV line on commas, honouring double-quoted fields.",
    ),
    (
        "def celsius_to_fahrenheit(celsius: float) -> float:",
        "Convert a temperature from Celsius to Fahrenheit.",
    ),
    (
        "def running_mean(values: list[float], window: int) -> list[float]:",
        "Mean of each window of consecutive values, in order.",
    ),
    (
        "def dedupe(items: list[str]) -> list[str]:",
        "Remove duplicates from items, keeping the first occurrence of each.",
    ),
    (
        "def roman_to_int(numeral: str) -> int:",
        "Convert a Roman numeral such as 'MCMXCIV' to an integer.",
    ),
    (
        "def caesar_cipher(text: str, shift: int) -> str:",
        "Shift each letter of text by shift places, keeping case; other characters unchanged.",
    ),
    (
        "def matrix_multiply(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:",
        "Multiply matrix a by matrix b; raise ValueError if the shapes do not match.",
    ),
    (
        "def read_config(path: str) -> dict[str, str]:",
        "Read key=value lines from a file, skipping blank lines and lines starting with '#'.",
    ),
    (
        "def top_k_frequent(words: list[str], k: int) -> list[str]:",
        "The k most frequent words, most frequent first, ties broken alphabetically.",
    ),
    (
        "def validate_email(address: str) -> bool:",
        "A simple check that address has one '@', a non-empty name and a dotted domain.",
    ),
    (
        "def rotate_left(items: list[int], steps: int) -> list[int]:",
        "Rotate items left by steps positions (steps may exceed the length).",
    ),
    (
        "def histogram(values: list[int]) -> str:",
        "One line per distinct value, in ascending order: the value, a colon and that many '*'.",
    ),
    (
        "def levenshtein(a: str, b: str) -> int:",
        "Edit distance between a and b: insertions, deletions and substitutions.",
    ),
)

CHAT = (
    "Explain the difference between a list and a tuple in Python, with an example of each.",
    "How do I read a large CSV file in Python without loading it all into memory?",
    "What is a race condition, and how can a mutex prevent one?",
    "Write a short guide to choosing good variable names.",
    "Why is binary search faster than linear search? Explain with an example.",
    "What does the HTTP status code 404 mean, and when should a server return 400 instead?",
    "Describe how a hash table handles collisions.",
    "What are the advantages of writing unit tests before fixing a bug?",
    "Explain recursion to a beginner, using the factorial function as an example.",
    "How does garbage collection work in Python?",
    "What is the difference between a process and a thread?",
    "Give three tips for making a slow SQL query faster.",
)


def code_prompt(signature: str, docstring: str) -> str:
    return f'{signature}\n    """{docstring}"""\n'


def workload_texts(kind: str, count: int) -> list[tuple[str, bool]]:
    """`count` prompts of the workload, in turn: (text, whether it is a chat message)."""
    if kind == "code":
        return [(code_prompt(*CODE[i % len(CODE)]), False) for i in range(count)]
    if kind == "chat":
        return [(CHAT[i % len(CHAT)], True) for i in range(count)]
    raise ValueError(f"unknown workload {kind!r}: code or chat")


def workload_prompts(tokenizer: Any, kind: str, count: int) -> list[list[int]]:
    """The workload's prompts as token ids: code as plain text, chat in the chat template."""
    return [
        chat_prompt_ids(tokenizer, text)
        if chat
        else [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
        for text, chat in workload_texts(kind, count)
    ]
