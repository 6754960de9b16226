"""The n-gram configuration and the prompts of the speculative-decoding checks: mixed lengths, code, repeats (tests and
tools/spec_bench.py)."""

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [
    "a b c a b c a b c a b c a b c",
    "hello",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n",
    [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8],
    "the cat sat on the mat, the cat sat on the",
    "x",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n",
]
