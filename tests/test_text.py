"""Tokenizer, streaming detokenization, chat templates and stop strings."""
import pytest

from deltaserve.chat import ChatTemplate, ChatTemplateError
from deltaserve.sampling import StopStrings
from deltaserve.tokenizer import IncrementalDecoder, Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer(tiny_dir, (482,))


def test_kimi_special_tokens_and_roundtrip(tok):
    text = "Hello, world! Café 你好 😀 numbers 12345"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("a<|im_end|>b")
    assert 482 in ids and tok.decode(ids) == "ab" and tok.decode(ids, skip_special_tokens=False) == "a<|im_end|>b"
    assert tok.token_id("<|im_middle|>") == 497 and tok.token_id("[PAD]") == 511


def test_streaming_never_emits_half_a_character(tok):
    text = "é😀你好 ok"
    ids = [b for ch in text.encode() for b in [ch]]   # one byte token per byte: worst case for splitting
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[0] == "" and pieces[1] == "é"       # the first byte of é waits for the second


def test_chat_template_renders_kimi_format(tok):
    rendered = ChatTemplate(tok.chat_template).render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert rendered == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
                        "<|im_assistant|>assistant<|im_middle|>")
    with pytest.raises(ChatTemplateError, match="messages\\[0\\]: needs a string 'role'"):
        ChatTemplate(None).render([{"content": "x"}])


def test_template_is_sandboxed():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(evil).render([{"role": "user", "content": "x"}])


def test_stop_strings_hold_back_possible_prefixes():
    stops = StopStrings(["END"])
    assert stops.split("hello E", final=False) == ("hello ", False)
    assert stops.split("hello EN", final=False) == ("hello ", False)
    assert stops.split("hello ENX", final=False) == ("hello ENX", False)
    assert stops.split("a END b", final=False) == ("a ", True)
    assert stops.split("tail E", final=True) == ("tail E", False)


def test_tokenizer_json_checkpoints_load_through_tokenizers(tmp_path):
    """Checkpoints without tiktoken.model use tokenizer.json via HF `tokenizers`; specials and streaming work."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["hello world, café 你好"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path, (0,))
    ids = tok.encode("hello café 你好<|im_end|>")
    assert ids[-1] == tok.token_id("<|im_end|>") and tok.decode(ids) == "hello café 你好"
    dec = IncrementalDecoder(tok)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == "hello café 你好"
