"""What the tests share: helpers, fixtures, fake data and the processes they start.

Test modules import from here and never from each other (tests/unit/test_test_layout.py holds
that): a test module is pytest's to collect, and importing one runs its module-level code a
second time under another name. Nothing here ships: the product packages have no test-only
modules, and the tiny models with the character tokenizer come from the product's own builder
(grpo_trainer.tiny_model), which the GPU benchmarks use too.
"""
