"""Role-wise advantages from segment masks vs a NumPy re-implementation of the reference rows.

The reference turns every generated message into its own training row keyed by
(instruction uid, role); a row's score is its trajectory's reward minus 0.1 if the output is
empty; the baseline is the mean over the rows of its key (mean 0 and std 1 for a key with one
row); A = score - mean (optionally / (std + eps)). `reference_advantages` rebuilds those rows
from the packed batch with plain Python and compares token by token.
"""

import jax
import numpy as np
import pytest

from envace_jax.rl import batch as tb
from envace_jax.rl.advantages import compute_advantages, role_mask, segment_table
from envace_jax.rl.config import GRPOConfig
from envace_jax.rl.synthetic import message_rows, random_batch
from envace_jax.text.codes import Role


def reference_rows(batch, cfg):
    """One dict per generated message, as the reference trainer would see it."""
    rows = []
    segs, roles = np.asarray(batch.segments), np.asarray(batch.roles)
    for i in range(segs.shape[0]):
        for s in sorted(set(segs[i][segs[i] > 0].tolist())):
            where = np.nonzero(segs[i] == s)[0]
            empty = len(where) <= cfg.empty_max_tokens
            score = float(batch.reward[i]) - (cfg.empty_penalty if empty else 0.0)
            role = int(roles[i, where[0]])
            key = f"{int(batch.group[i])}_{role}" if cfg.baseline == "role" else str(batch.group[i])
            rows.append(dict(row=i, positions=where, role=role, score=score, key=key))
    return rows


def reference_advantages(batch, cfg):
    rows = reference_rows(batch, cfg)
    by_key = {}
    for r in rows:
        by_key.setdefault(r["key"], []).append(r["score"])
    stats = {}
    for key, scores in by_key.items():
        if len(scores) == 1:
            stats[key] = (0.0, 1.0) if cfg.singleton_baseline == "zero" else (scores[0], 1.0)
        else:
            stats[key] = (np.mean(scores), np.std(scores, ddof=1))
    adv = np.zeros(np.asarray(batch.tokens).shape)
    for r in rows:
        mean, std = stats[r["key"]]
        a = r["score"] - mean
        if cfg.norm_adv_by_std:
            a = a / (std + cfg.std_eps)
        adv[r["row"], r["positions"]] = a
    return adv, rows


def with_singleton(batch, row):
    """Gives `row` a group of its own holding one message: the reference's singleton case."""
    segs, roles = np.array(batch.segments), np.array(batch.roles)
    group = np.array(batch.group)
    segs[row, 4:] = 0
    roles[row, 4:] = 0
    segs[row, :4] = [0, 0, 1, 1]
    roles[row, :4] = [0, 0, Role.REHEARSE, Role.REHEARSE]
    group[row] = group.max() + 1
    return batch.replace(segments=segs, roles=roles, group=group)


CONFIGS = {
    "reference": GRPOConfig(),
    "std": GRPOConfig(norm_adv_by_std=True),
    "group_baseline": GRPOConfig(baseline="group"),
    "singleton_self": GRPOConfig(singleton_baseline="self"),
    "no_penalty_two_token_empty": GRPOConfig(empty_penalty=0.0, empty_max_tokens=2),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_reference_rows(name):
    cfg = CONFIGS[name]
    fn = jax.jit(lambda r, s, g, w: compute_advantages(r, s, g, w, cfg))
    seen = dict(singleton=0, missing_role=0, no_message_rows=0, empty=0)
    for seed in range(12):
        rng = np.random.default_rng(seed)
        batch = with_singleton(
            random_batch(rng, batch_size=12, seq_len=40, num_groups=3, padding_rows=2), row=9
        )
        tb.validate(batch)
        got, metrics = fn(batch.roles, batch.segments, batch.group, batch.reward)
        want, rows = reference_advantages(batch, cfg)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
        # The batches must exercise the edge cases the reference treats specially.
        keys = [r["key"] for r in rows]
        seen["singleton"] += sum(keys.count(k) == 1 for k in set(keys))
        seen["missing_role"] += sum(f"{g}_2" not in keys for g in range(3))
        seen["no_message_rows"] += sum(
            1 for i in range(10) if not (np.asarray(batch.segments)[i] > 0).any()
        )
        seen["empty"] += sum(len(r["positions"]) == 1 for r in rows)
        for role, rname in ((1, "act"), (2, "rehearse")):
            mine = [r for r in rows if r["role"] == role]
            assert float(metrics[f"{rname}/outputs"]) == len(mine)
            assert float(metrics[f"{rname}/tokens"]) == sum(len(r["positions"]) for r in mine)
            if mine:
                a = np.array([want[r["row"], r["positions"][0]] for r in mine])
                np.testing.assert_allclose(float(metrics[f"{rname}/adv_mean"]), a.mean(), atol=1e-6)
                np.testing.assert_allclose(float(metrics[f"{rname}/adv_std"]), a.std(), atol=1e-6)
    if cfg.baseline == "role":
        assert all(v > 0 for v in seen.values()), seen


def test_trajectory_with_more_messages_weighs_more():
    # Group 0: row 0 (R=1) has three ACT messages, row 1 (R=0) has one. Counted per output
    # the ACT baseline is 3/4, not the per-trajectory 1/2.
    segs = np.array([[0, 1, 1, 0, 2, 2, 0, 3, 3], [0, 1, 1, 0, 0, 0, 0, 0, 0]])
    batch = tb.from_numpy(
        tokens=np.ones_like(segs),
        roles=(segs > 0).astype(np.int8),
        segments=segs,
        group=[0, 0],
        reward=[1.0, 0.0],
    )
    tb.validate(batch)
    adv, _ = compute_advantages(
        batch.roles, batch.segments, batch.group, batch.reward, GRPOConfig()
    )
    np.testing.assert_allclose(np.asarray(adv)[0, 1], 0.25)
    np.testing.assert_allclose(np.asarray(adv)[1, 1], -0.75)
    assert (np.asarray(adv)[segs == 0] == 0).all()


def test_singleton_role_gets_raw_score_like_the_reference():
    # One REHEARSE output in the group: the reference uses mean 0, so A = R.
    segs = np.array([[1, 1, 2, 2], [1, 1, 0, 0]])
    roles = np.array([[1, 1, 2, 2], [1, 1, 0, 0]])
    batch = tb.from_numpy(
        tokens=np.ones_like(segs), roles=roles, segments=segs, group=[0, 0], reward=[0.5, 0.1]
    )
    adv, _ = compute_advantages(
        batch.roles, batch.segments, batch.group, batch.reward, GRPOConfig()
    )
    np.testing.assert_allclose(np.asarray(adv)[0, 2], 0.5)
    adv, _ = compute_advantages(
        batch.roles,
        batch.segments,
        batch.group,
        batch.reward,
        GRPOConfig(singleton_baseline="self"),
    )
    np.testing.assert_allclose(np.asarray(adv)[0, 2], 0.0)


def test_segment_table_and_role_mask():
    segs = np.array([[0, 1, 1, 2, 0, 3]])
    roles = np.array([[0, 1, 1, 2, 0, 1]])
    ntok, role = segment_table(roles, segs)
    assert np.asarray(ntok)[0, :4].tolist() == [2, 2, 1, 1]
    assert np.asarray(role)[0, 1:4].tolist() == [1, 2, 1]
    assert np.asarray(role_mask(roles, segs, (2,))).tolist() == [[0, 0, 0, 1, 0, 0]]


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("roles", [[0, 3, 0, 0]], "role outside"),
        ("segments", [[0, 1, 1, 1]], "exactly on ACT and REHEARSE"),
        ("segments", [[0, 2, 0, 0]], "expected 1"),
        ("segments", [[0, 1, 0, 0]], None),
        ("group", [5], "group id outside"),
        ("lengths", [1], "at or after lengths"),
    ],
)
def test_validate_names_the_bad_field(field, value, message):
    fields = dict(
        tokens=[[5, 6, 7, 0]],
        roles=[[0, 1, 0, 0]],
        segments=[[0, 1, 0, 0]],
        group=[0],
        reward=[1.0],
        lengths=[3],
    )
    fields[field] = value
    batch = tb.from_numpy(**fields)
    if message is None:
        tb.validate(batch)
        return
    with pytest.raises(ValueError, match=message) as e:
        tb.validate(batch)
    assert "row 0" in str(e.value)


def test_validate_rejects_split_and_mixed_role_messages():
    split = tb.from_numpy(
        tokens=[[1] * 6],
        roles=[[0, 1, 1, 0, 1, 0]],
        segments=[[0, 1, 1, 0, 1, 0]],
        group=[0],
        reward=[0.0],
    )
    with pytest.raises(ValueError, match="position 4: messages must be contiguous"):
        tb.validate(split)
    mixed = tb.from_numpy(
        tokens=[[1] * 4], roles=[[0, 1, 2, 0]], segments=[[0, 1, 1, 0]], group=[0], reward=[0.0]
    )
    with pytest.raises(ValueError, match="position 2"):
        tb.validate(mixed)
    first = tb.from_numpy(
        tokens=[[1] * 2], roles=[[1, 0]], segments=[[1, 0]], group=[0], reward=[0.0]
    )
    with pytest.raises(ValueError, match="position 0 must be context"):
        tb.validate(first)


def test_pad_to_bucket_keeps_advantages():
    batch = random_batch(np.random.default_rng(3), batch_size=6, seq_len=30, num_groups=2)
    padded = tb.pad_to_bucket(batch, (16, 48, 64), batch_size=8)
    assert padded.shape == (8, 48)
    tb.validate(padded)
    cfg = GRPOConfig()
    a, _ = compute_advantages(batch.roles, batch.segments, batch.group, batch.reward, cfg)
    p, _ = compute_advantages(padded.roles, padded.segments, padded.group, padded.reward, cfg)
    np.testing.assert_allclose(np.asarray(p)[:6, :30], np.asarray(a), atol=1e-7)
    assert (np.asarray(p)[6:] == 0).all() and (np.asarray(p)[:, 30:] == 0).all()
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        tb.pad_to_bucket(batch, (8,))


def test_renumber_groups():
    assert tb.renumber_groups(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]


def test_message_rows_keep_each_messages_advantage():
    # The one-row-per-message layout (what the reference trains on) gives every message the
    # advantage it has in the packed layout.
    batch = random_batch(np.random.default_rng(4), batch_size=6, seq_len=30, num_groups=2)
    rows = message_rows(batch)
    tb.validate(rows)
    cfg = GRPOConfig()
    packed, _ = compute_advantages(batch.roles, batch.segments, batch.group, batch.reward, cfg)
    per_row, _ = compute_advantages(rows.roles, rows.segments, rows.group, rows.reward, cfg)
    want = [a for a in np.asarray(packed)[np.asarray(batch.segments) > 0]]
    got = [a for a in np.asarray(per_row)[np.asarray(rows.segments) > 0]]
    np.testing.assert_allclose(got, want, atol=1e-6)  # both in row-major message order
