"""Marker strings (special-token text such as `<think>` or `<|tool_call_begin|>`) in text that arrives in pieces:
find the first complete one, and hold back a tail that may still grow into one, so half a marker is never
released as ordinary text."""
from __future__ import annotations

from typing import Iterable


def split_at_marker(text: str, markers: Iterable[str], final: bool) -> tuple[str, str | None, str]:
    """(text before the first complete marker, that marker, the text after it). Without a complete marker:
    (the part that is safe to release, None, the held tail that is a proper prefix of a marker); `final` means
    no more text will come, so nothing is held."""
    markers = tuple(markers)
    best, found = len(text), None
    for m in markers:
        i = text.find(m, 0, best + len(m))
        if i != -1 and (i < best or i == best and len(m) > len(found or "")):
            best, found = i, m
    if found is not None:
        return text[:best], found, text[best + len(found):]
    if final:
        return text, None, ""
    keep = held_tail(text, markers)
    return text[:len(text) - keep], None, text[len(text) - keep:]


def held_tail(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), longest, -1):
            if text.endswith(m[:k]):
                longest = k
                break
    return longest
