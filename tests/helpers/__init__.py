"""What the tests share. Modules the tests import: `hf` (HF transformers' own answers: greedy
decoding, exact joint laws of a few sampled tokens), `stats` (chi-square goodness of fit) and
`trees` (small draft trees). Scripts the tests run in their own processes: `launcher_args`,
`sglang_dflash_logits`, `capture_explain`. Fixtures live in ../conftest.py."""
