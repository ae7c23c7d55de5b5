"""Corpus and tokenizer of the embedded default model, rebuilt from Debian's python3.11-doc package.

    apt-get install -y python3.11-doc
    .venv/bin/python scripts/prepare_corpus.py /tmp/deltaserve-corpus

writes train.txt (the training text), heldout.txt (prose paragraphs of held-out tutorial pages, committed as
tests/data/heldout.txt) and tokenizer/ (a byte-level BPE in Kimi's tiktoken layout with Kimi's special tokens and chat
template). The sources are the reStructuredText files Sphinx ships with the HTML (PSF licence); Sphinx markup that
is not text (index entries, labels, roles) is reduced to the words a reader sees, so the model learns prose and code.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
# Changelogs (whatsnew), the C API and the retired distutils docs are mostly lists of names; the rest is prose and code.
SKIPPED_DIRS = ("whatsnew", "c-api", "distutils")
# Whole pages held out from training; their first prose paragraphs, up to HELDOUT_CHARS, are the perplexity sample
# (about 4,000 tokens: enough to separate the fast paths, small enough to score in a few seconds in the tests).
HELDOUT_PAGES = ("tutorial/classes.rst.txt", "tutorial/appetite.rst.txt")
HELDOUT_CHARS = 16_000
VOCAB_SIZE = 4096            # ranks + Kimi's 256-id special block at the top
SPECIAL_BLOCK = 256

# Explicit markup whose block carries no text a reader sees: index entries, labels, comments, layout directives.
NOISE_DIRECTIVE = re.compile(r"\.\. (?:_[^:]*:|index::|highlight::|sectionauthor::|moduleauthor::|toctree::|"
                             r"tabularcolumns::|testsetup::|testcleanup::|only::|raw::|include::|literalinclude::|"
                             r"\|[^|]+\| replace::|(?![\w-]+::)(?!_)\S)|\.\.$")
ROLE = re.compile(r":[\w:+-]+:`([^`]+)`")
OPTION_LINE = re.compile(r"^\s+:(?:noindex|no-index|synopsis|platform|deprecated|module|annotation|type|value):.*$")


def source_files(root: Path = SOURCES) -> list[Path]:
    if not root.is_dir():
        raise SystemExit(f"{root} not found: install Debian's python3.11-doc (apt-get install -y python3.11-doc)")
    return sorted(p for p in root.rglob("*.rst.txt") if p.relative_to(root).parts[0] not in SKIPPED_DIRS)


def _role_text(m: re.Match) -> str:
    """`:func:`~os.path.join`` -> join, `:ref:`the tutorial <tut-x>`` -> the tutorial, as Sphinx renders them."""
    text = m.group(1)
    titled = re.fullmatch(r"(.+?)\s*<[^<>]+>", text, re.S)
    if titled:
        return titled.group(1)
    text = text.lstrip("!")
    return text.rsplit(".", 1)[-1] if text.startswith("~") else text


def clean_rst(text: str) -> str:
    """Drop noise directives with their indented bodies and option lines; reduce roles to their text."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if skipping and (not line.strip() or line[:1].isspace()):
            continue
        skipping = bool(NOISE_DIRECTIVE.match(line))
        if skipping or OPTION_LINE.match(line):
            continue
        out.append(ROLE.sub(_role_text, line).rstrip())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def prose_paragraphs(text: str) -> list[str]:
    """Unindented paragraphs of sentences: no headings, directives, literal blocks or interactive sessions."""
    keep = []
    for para in re.split(r"\n\s*\n", text):
        lines = para.split("\n")
        if (len(para) < 80 or para[0].isspace() or para.startswith(("..", ">>>", "*", "-", "+", "|"))
                or any(re.fullmatch(r"([=*\-~^#\"'`])\1{2,}", ln) for ln in lines)):
            continue
        if sum(c.isalpha() or c == " " for c in para) / len(para) > 0.85:
            keep.append(para)
    return keep


def build_corpus(root: Path = SOURCES) -> tuple[str, str]:
    """(training text, held-out prose): documents in path order separated by a blank line."""
    train, heldout = [], []
    for path in source_files(root):
        text = clean_rst(path.read_text(encoding="utf-8"))
        if str(path.relative_to(root)) in HELDOUT_PAGES:
            heldout.extend(prose_paragraphs(text))
        else:
            train.append(text)
    sample = ""
    for para in heldout:
        if len(sample) + len(para) + 2 > HELDOUT_CHARS:
            break
        sample += para + "\n\n"
    return "\n".join(train), sample.rstrip("\n") + "\n"


def train_bpe(text: str, num_ranks: int) -> list[bytes]:
    """Byte-level BPE trained with HF tokenizers under Kimi's pre-tokenizer regex; returns tokens in rank order
    (the 256 bytes, then one token per merge, in merge order, which is how tiktoken ranks merges)."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from deltaserve.tokenizer import KIMI_PAT_STR
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=num_ranks, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([text], trainer)
    # merges are [left, right] pairs (tokenizers >= 0.20) or "left right" strings (older releases)
    merges = [m.split(" ") if isinstance(m, str) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    # ByteLevel writes byte b as a printable character; invert that table to get the merged byte strings.
    byte_of = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
    to_bytes = lambda s: bytes(byte_of[c] for c in s)
    return [bytes([b]) for b in range(256)] + [to_bytes(a) + to_bytes(b) for a, b in merges]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (the one HF ByteLevel uses), indexed by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_kimi_tokenizer(dst: Path, tokens: list[bytes], vocab_size: int = VOCAB_SIZE) -> None:
    """tiktoken.model ("base64(token) rank" lines) plus tokenizer_config.json and chat_template.jinja as
    deltaserve.tiny writes them for this vocabulary size (Kimi's named specials in the top 256 ids)."""
    import base64

    from deltaserve.tiny import write_tokenizer
    if len(tokens) != vocab_size - SPECIAL_BLOCK or len(set(tokens)) != len(tokens):
        raise ValueError(f"{len(tokens)} distinct ranks expected {vocab_size - SPECIAL_BLOCK}")
    dst.mkdir(parents=True, exist_ok=True)
    write_tokenizer(dst, vocab_size)            # special block, config and template; its toy BPE is replaced below
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (dst / "tiktoken.model").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory for train.txt, heldout.txt and tokenizer/")
    args = ap.parse_args()
    train, heldout = build_corpus()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train.txt").write_text(train, encoding="utf-8")
    (args.out / "heldout.txt").write_text(heldout, encoding="utf-8")
    tokens = train_bpe(train, VOCAB_SIZE - SPECIAL_BLOCK)
    write_kimi_tokenizer(args.out / "tokenizer", tokens)
    print(f"train.txt {len(train):,} chars, heldout.txt {len(heldout):,} chars, {len(tokens)} ranks")


if __name__ == "__main__":
    main()
