import numpy as np
import pytest

from ms_llm.data import ByteTokenizer, GlobalBatchSampler, SamplerState, build_stdlib_corpus, load_tokens
from ms_llm.errors import ConfigError


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return load_tokens(build_stdlib_corpus(tmp_path_factory.mktemp("data"), max_bytes=200_000))


def test_corpus_is_cached_and_byte_exact(tmp_path):
    a = build_stdlib_corpus(tmp_path, max_bytes=50_000)
    mtime = a.stat().st_mtime_ns
    assert build_stdlib_corpus(tmp_path, max_bytes=50_000) == a and a.stat().st_mtime_ns == mtime
    toks = load_tokens(a)
    assert toks.max() <= ByteTokenizer.EOS and (toks == ByteTokenizer.EOS).sum() >= 1
    first_doc = toks[:int(np.argmax(toks == ByteTokenizer.EOS))]
    assert ByteTokenizer().decode(first_doc).startswith((b'"""', b"#", b"'''", b"import", b"from"))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_global_batch_identical_for_any_dp(tokens, dp):
    s = GlobalBatchSampler(tokens, seq_len=32, global_batch=8, seed=3)
    for step in (0, 1, 57):
        full = s.local_batch(step)
        parts = np.concatenate([s.local_batch(step, r, dp) for r in range(dp)])
        assert np.array_equal(full, parts)


def test_resume_from_state_continues_exactly(tokens):
    s = GlobalBatchSampler(tokens, seq_len=32, global_batch=8, seed=3)
    state = s.state_at(123)
    again = GlobalBatchSampler(tokens, seq_len=32, global_batch=8, seed=3)
    assert again.step_of(state) == 123
    assert np.array_equal(s.local_batch(123), again.local_batch(again.step_of(state)))
    epoch_steps = s.num_samples // 8
    assert s.state_at(epoch_steps).epoch == 1
    assert not np.array_equal(s.global_indices(0), s.global_indices(epoch_steps))


def test_errors_name_the_field(tokens, tmp_path):
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        GlobalBatchSampler(tokens[:100], seq_len=32, global_batch=8, seed=0)
    with pytest.raises(ConfigError, match="train.data.source"):
        load_tokens(tmp_path / "missing.bin")
    with pytest.raises(ConfigError, match="train.seed"):
        GlobalBatchSampler(tokens, 32, 8, seed=1).step_of(GlobalBatchSampler(tokens, 32, 8, seed=2).state_at(1))
    with pytest.raises(ConfigError, match="train.global_batch_size: 8 is not divisible by dp=3"):
        GlobalBatchSampler(tokens, 32, 8, seed=1).local_batch(0, 0, 3)


def test_a_token_file_run_refuses_an_indexed_datasets_checkpoint(tokens):
    """A checkpoint's sampler state from indexed data (it carries its order's key) cannot resume
    a token-file run, and an old state without the key still loads."""
    s = GlobalBatchSampler(tokens, 32, 8, seed=1)
    with pytest.raises(ConfigError, match="train.data: the checkpoint read indexed datasets"):
        s.step_of(SamplerState(1, 0, 16, index="0123abcd"))
    assert s.step_of(SamplerState.from_dict({"seed": 1, "epoch": 0, "position": 16})) == 2
