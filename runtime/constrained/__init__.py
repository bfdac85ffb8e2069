"""Structured output: grammars compiled once per spec (compiler.py, used by the frontend to refuse a
bad spec with a 400 and by the worker to build matchers) and each row's constraint state in the
worker (row_state.py: the token bitmask of its next step)."""
