"""GPT samples, splits and blends over indexed datasets: the order, its cache in the run folder,
the sampler interface the loop uses (dp-independent batches, sample-exact resume), the
validation batches, the launcher's checks, and every bad input as one line naming the field."""
import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from ms_llm.config.schema import from_dict
from ms_llm.config.train import TrainConfig
from ms_llm.data import IndexedDataset, IndexedDatasetWriter, SamplerState
from ms_llm.data.blend import blend_order, normalize, split_bounds
from ms_llm.data.gpt import GPTSamples, build_indices
from ms_llm.data import samples
from ms_llm.errors import ConfigError
from ms_llm.launch import TrainRequest, prepare

ROOT = Path(__file__).resolve().parents[2]


def tagged(prefix: Path, n_docs: int, base: int = 0, seed: int = 0) -> str:
    """Document i is `base + i` repeated (1..40 times): every token names its dataset and document."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(n_docs):
            w.add_document(np.full(int(rng.integers(1, 40)), base + i))
    return str(prefix)


def train_config(paths, weights=(), split="969,30,1", seq_len=16, seed=5, steps=20, batch=8) -> TrainConfig:
    return from_dict(TrainConfig, {"seq_len": seq_len, "seed": seed, "steps": steps, "global_batch_size": batch,
                                   "data": {"paths": list(paths), "weights": list(weights), "split": split}}, "train")


@pytest.fixture
def two(tmp_path) -> list[str]:
    return [tagged(tmp_path / "a", 200), tagged(tmp_path / "b", 300, base=1000, seed=1)]


def test_samples_run_across_document_boundaries_in_the_shuffled_document_order(tmp_path):
    ds = IndexedDataset(tagged(tmp_path / "a", 50))
    ix = build_indices(ds.sizes, np.arange(50), 16, 60, seed=3)
    stream = np.concatenate([ds[int(d)] for d in ix.document])
    gpt = GPTSamples(ds, ix, 16)
    assert len(gpt) >= 60 and sorted(ix.shuffle.tolist()) == list(range(len(gpt)))
    expect = np.stack([stream[s * 16:s * 16 + 17] for s in ix.shuffle.tolist()])   # seq_len + 1, overlapping by one
    rows = gpt.rows(np.arange(len(gpt)))
    assert np.array_equal(rows, expect) and np.array_equal(gpt.sample(7), expect[7])
    assert (rows.min(axis=1) != rows.max(axis=1)).sum() > len(gpt) // 2       # most cross a document boundary
    again = build_indices(ds.sizes, np.arange(50), 16, 60, seed=3)
    other = build_indices(ds.sizes, np.arange(50), 16, 60, seed=4)
    assert np.array_equal(again.shuffle, ix.shuffle) and np.array_equal(again.document, ix.document)
    assert not np.array_equal(other.document, ix.document)


def test_split_follows_megatron():
    assert split_bounds((0.969, 0.03, 0.001), 20) == [(0, 19), (19, 20), (20, 20)]
    assert split_bounds((0.5, 0.5, 0.0), 7) == [(0, 4), (4, 7), (7, 7)]
    assert train_config(["x"], split="969,30,1").data.split_fractions() == (0.969, 0.03, 0.001)
    assert train_config(["x"], split="1").data.split_fractions() == (1.0, 0.0, 0.0)


def test_blend_keeps_every_prefix_near_its_share():
    w = normalize([2, 5, 3])
    dataset_of, sample_of = blend_order(w, 10_000)
    counts = np.stack([np.cumsum(dataset_of == d) for d in range(3)], axis=1)
    assert np.abs(counts - w * np.arange(1, 10_001)[:, None]).max() <= 2
    for d in range(3):                          # each dataset's samples are taken in their own order
        assert np.array_equal(sample_of[dataset_of == d], np.arange(counts[-1, d]))


def test_a_blended_run_same_rows_for_any_dp_and_sample_exact_resume(tmp_path, two):
    t = train_config(two, weights=(1, 3), steps=20)
    samples.build(samples.DataSpec.of(t), tmp_path / "cache")
    sampler = samples.train_sampler(t, tmp_path / "cache")
    rows = np.concatenate([sampler.local_batch(k) for k in range(20)])
    assert rows.shape == (160, 17)
    from_b = (rows[:, 0] >= 1000).mean()
    assert abs(from_b - 0.75) < 0.02
    train_docs = {0: 194, 1000: 1000 + 291}                   # round(0.969 * n) documents each
    assert all(v < train_docs[1000 if v >= 1000 else 0] for v in rows.ravel())   # never a valid document
    for k in (0, 7, 19):
        for dp in (2, 4):
            parts = np.concatenate([sampler.local_batch(k, r, dp) for r in range(dp)])
            assert np.array_equal(parts, sampler.local_batch(k))

    state = SamplerState.from_dict(sampler.state_at(13).to_dict())       # through the checkpoint's JSON
    resumed = samples.train_sampler(t, tmp_path / "cache")                # a fresh process, say, at dp 4
    k = resumed.step_of(state)
    assert k == 13 and np.array_equal(np.concatenate([resumed.local_batch(k, r, 4) for r in range(4)]),
                                      sampler.local_batch(13))
    longer = train_config(two, weights=(1, 3), steps=25)                   # more steps, the same epochs:
    samples.build(samples.DataSpec.of(longer), tmp_path / "cache")          # the order extends, resume allowed
    extended = samples.train_sampler(longer, tmp_path / "cache")
    assert extended.step_of(state) == 13
    assert np.array_equal(np.concatenate([extended.local_batch(k) for k in range(20)]), rows)
    for changed in (train_config(two, weights=(1, 2), steps=20), train_config(two, weights=(1, 3), steps=200)):
        samples.build(samples.DataSpec.of(changed), tmp_path / "cache")     # other weights; a second epoch
        with pytest.raises(ConfigError, match="train.data: the checkpoint's data order .* is not this run's"):
            samples.train_sampler(changed, tmp_path / "cache").step_of(state)
    with pytest.raises(ConfigError, match="train.steps: step 20 is past the 160 samples"):
        sampler.local_batch(20)


def test_the_order_is_cached_and_rebuilt_only_when_its_inputs_change(tmp_path, two):
    cache = tmp_path / "cache"
    t = train_config(two)
    first = samples.build(samples.DataSpec.of(t), cache)
    built = (first / "manifest.json").stat().st_mtime_ns
    assert samples.build(samples.DataSpec.of(t), cache) == first
    assert (first / "manifest.json").stat().st_mtime_ns == built
    assert sorted(p.name for p in cache.iterdir()) == [first.name, "samples.json"]     # no temporaries left
    for other in (dataclasses.replace(t, seq_len=8), dataclasses.replace(t, seed=6), dataclasses.replace(t, steps=21),
                  train_config(two, split="90,10"), train_config(two, weights=(1, 1))):
        assert samples.build(samples.DataSpec.of(other), cache) != first
    with pytest.raises(ConfigError, match="train.data: the sample order in .* was built for"):
        samples.train_sampler(t, cache)                       # samples.json names the last build, for steps=21...
    copy = tmp_path / "copy"                                  # ...a node's own copy of the data: the same order
    copy.mkdir()
    for suffix in (".bin", ".idx"):
        (copy / f"a{suffix}").write_bytes(Path(f"{two[0]}{suffix}").read_bytes())
    assert samples.build(samples.DataSpec.of(train_config([str(copy / "a"), two[1]])), cache) == first
    tagged(Path(two[0]), 201)                                                          # the data changed
    assert samples.build(samples.DataSpec.of(t), cache) != first


def test_validation_batches_are_fixed_and_come_from_the_valid_split(tmp_path, two):
    t = train_config(two, split="80,20", steps=4, batch=4)
    samples.build(samples.DataSpec.of(t), tmp_path)
    valid = samples.valid_batches(t, tmp_path)
    first, again = valid.batches(2), samples.valid_batches(t, tmp_path).batches(2)
    assert len(first) == 2 and first[0].shape == (4, 17)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    tokens = np.concatenate(first).ravel()
    assert (((tokens >= 160) & (tokens < 200)) | (tokens >= 1240)).all()             # the last 20% of each
    with pytest.raises(ConfigError, match=r"train.eval.batches: 999 batches of 4"):
        valid.batches(999)
    no_valid = train_config(two, split="1", steps=4, batch=4)
    samples.build(samples.DataSpec.of(no_valid), tmp_path)
    assert samples.valid_batches(no_valid, tmp_path) is None


@pytest.mark.parametrize("data,message", [
    ({"paths": ["a", "b"], "weights": [1]}, "train.data.weights: 1 weights for 2 paths"),
    ({"paths": ["a"], "weights": [0]}, "train.data.weights: all weights are 0"),
    ({"paths": ["a"], "weights": [-1]}, r"train.data.weights\[0\]: got -1.0; must be >= 0"),
    ({"paths": ["a"], "split": "0,0,0"}, "train.data.split: got '0,0,0'"),
    ({"paths": ["a"], "split": "train"}, "train.data.split: got 'train'"),
])
def test_bad_data_config_is_one_line_naming_the_field(data, message):
    with pytest.raises(ConfigError, match=message) as err:
        from_dict(TrainConfig, {"data": data}, "train")
    assert "\n" not in str(err.value)


def job_file(tmp_path: Path, data: dict, vocab: int = 2000) -> Path:
    job = yaml.safe_load((ROOT / "configs/train/tiny_torch_dp2.yaml").read_text())
    job["model"] = {"name": "tiny_data", "vocab_size": vocab, "hidden_size": 32, "num_layers": 1, "num_heads": 2,
                    "num_kv_heads": 2, "ffn_hidden_size": 64, "max_seq_len": 16}
    job["train"] |= {"seq_len": 16, "steps": 3, "data": data}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_the_launcher_resolves_checks_and_builds_the_order_before_workers(tmp_path, two, monkeypatch):
    (tmp_path / "tok.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    job, _, run = prepare(TrainRequest(job_file(tmp_path, {"paths": ["a", "b"], "tokenizer": "tok.json"}),
                                       run_dir=tmp_path / "run"))
    assert job.train.data.paths == tuple(two) and job.train.data.tokenizer == str(tmp_path / "tok.json")
    assert sorted(p.name for p in run.data.iterdir()) == [f"samples-{samples.DataSpec.of(job.train).key()}",
                                                          "samples.json"]
    with pytest.raises(ConfigError, match=r"^model.vocab_size: 1000, but .*b holds token id 1299; use vocab_size "
                                          r">= 1300"):
        prepare(TrainRequest(job_file(tmp_path, {"paths": ["a", "b"]}, vocab=1000), run_dir=tmp_path / "r2"))
    with pytest.raises(ConfigError, match=r"train.data.paths\[1\]: indexed dataset: .*nope.idx does not exist"):
        prepare(TrainRequest(job_file(tmp_path, {"paths": ["a", "nope"]}), run_dir=tmp_path / "r3"))
    with pytest.raises(ConfigError, match="train.data.tokenizer: 'gone.json' does not exist"):
        prepare(TrainRequest(job_file(tmp_path, {"paths": ["a"], "tokenizer": "gone.json"}), run_dir=tmp_path / "r4"))
    os.replace(f"{two[1]}.bin", f"{two[0]}.bin")
    with pytest.raises(ConfigError, match=r"train.data.paths\[0\]: .*does not match its \.bin"):
        prepare(TrainRequest(job_file(tmp_path, {"paths": ["a"]}), run_dir=tmp_path / "r5"))
