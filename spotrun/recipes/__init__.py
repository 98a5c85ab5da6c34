"""Jobs written on spotrun's public API and shipped with it (the built-in character LM)."""
