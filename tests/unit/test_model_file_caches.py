"""Start-up caches of the model file: the GGUF's tokenizer kept as tokenizer.json, and one GGUF parse per process.
Both must give exactly what the uncached paths give (transformers' own GGUF conversion; gguf's own GGUFReader)."""
from __future__ import annotations

import os

from shared.model import gguf_loader, loader
from shared.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Héllo <|im_end|> wörld 12345\n\tdef f(x): return x ** 2  # ünïcode ✓"}]


def test_cached_tokenizer_equals_transformers_conversion(model_path, hf_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = Tokenizer(model_path)                                        # converts, then writes the cache
    saved = list((tmp_path / "upesi" / "tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer.json").exists()
    second = Tokenizer(model_path)                                       # reads tokenizer.json
    assert type(second.hf).__name__ == type(hf_tokenizer).__name__
    ids = list(range(0, len(hf_tokenizer), 5))
    for tok in (first, second):
        text = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert tok.apply_chat_template(MESSAGES) == hf_tokenizer.encode(text, add_special_tokens=False)
        assert tok.encode(MESSAGES[1]["content"]) == hf_tokenizer.encode(MESSAGES[1]["content"],
                                                                         add_special_tokens=False)
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True,
                                                      clean_up_tokenization_spaces=False)
        assert tok.convert_ids_to_tokens(ids) == hf_tokenizer.convert_ids_to_tokens(ids)
        assert tok.eos_token_id == hf_tokenizer.eos_token_id
        assert tok.hf.all_special_ids == hf_tokenizer.all_special_ids


def test_unwritable_cache_still_loads(model_path, hf_tokenizer, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))                  # mkdir under a file fails
    tok = Tokenizer(model_path)
    assert tok.encode("hello world") == hf_tokenizer.encode("hello world", add_special_tokens=False)


def test_gguf_is_parsed_once_per_start_up_and_the_parse_is_dropped_after_the_weights(model_path, tmp_path,
                                                                                     monkeypatch):
    import gguf

    from shared.model import gguf_index

    opened = []
    real = gguf_index.GGUFIndex
    monkeypatch.setattr(gguf_index, "GGUFIndex", lambda path: opened.append(path) or real(path))   # the real index
    gguf_loader._reader.cache_clear()
    gguf_loader._parsed_config.cache_clear()
    cfg = loader.load_config(model_path)
    assert loader.load_config(model_path) == cfg                        # a shard asks twice
    names = [name for name, _ in loader.iter_weights(model_path, cfg, progress=False)]
    assert len(opened) == 1                                             # config and weights share one parse
    assert gguf_loader._reader.cache_info().currsize == 0                    # dropped once the weights are read
    fresh = gguf.GGUFReader(model_path)                                 # independent: the file's own fields
    assert cfg.hidden_size == fresh.fields["llama.embedding_length"].contents()
    assert cfg.num_layers == fresh.fields["llama.block_count"].contents()
    assert len(names) == len(fresh.tensors)
    cfg.eos_token_ids.append(-1)                                        # a caller's change stays its own
    assert -1 not in loader.load_config(model_path).eos_token_ids
    assert len(opened) == 1                                             # later configs come from the cache
    # another file (a copy with a new mtime) is parsed on its own
    copy = tmp_path / os.path.basename(model_path)
    copy.write_bytes(open(model_path, "rb").read())
    assert loader.load_config(str(copy)).hidden_size == cfg.hidden_size
    assert opened[1:] == [str(copy)]
