"""Lines that the tests of GPT-2 BPE (our encoder, the exported tokenizer)
encode: contractions, unicode, numbers, runs of whitespace, Wikitext's
@-@ and heading marks, quotes."""

VARIED = [
    "Hello world! It's 2024; we'll see you're fine, they've said, I'm sure he'd agree.",
    "naïve café — Zürich 東京 😀 emoji and ÜBER-ümlauts",
    "numbers 12,345.67 and 3.14159 and 1e-9 and 007",
    "long    whitespace\t\truns   and trailing spaces   ",
    "   leading spaces, tabs\tand (brackets) [x] {y} <z> @-@ = = heading = =",
    "''quoted'' \"double\" `back` ...ellipsis--dash",
]
