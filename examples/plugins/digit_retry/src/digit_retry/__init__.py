"""digit_retry: reverse a number's digits, with a hint and a second attempt; a task of its own
for tandem, as a plugin package (docs/extending.md).

Nothing is imported here: `digit_retry.plugin` registers every item by `module:attr`, and each
process imports only the modules its part of the run uses.
"""
