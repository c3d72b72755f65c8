"""Prompt text the end-to-end tests share: a small function that copy-friendly prompts
repeat (an edit copies it, a continuation writes more code)."""

PARSE_HEADER = '''def parse_header(line):
    """Split a header line into a key and a value."""
    key, sep, value = line.partition(":")
    if not sep:
        raise ValueError("not a header: %r" % (line,))
    return key.strip().lower(), value.strip()
'''
