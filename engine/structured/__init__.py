"""Structured outputs: grammars compiled with llguidance, matchers, token bitmasks."""
