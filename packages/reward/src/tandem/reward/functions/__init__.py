"""The built-in reward functions; importing this package registers them."""

from . import code_tests, format, k12, math_answer, reward_model, vision  # noqa: F401
