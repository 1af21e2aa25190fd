"""On 8 fake CPU devices (data 2 x fsdp 2 x tensor 2) the train steps give the same params as
on one device. Runs in a subprocess so the fake-device flag never leaks into other tests."""

import subprocess
import sys
import textwrap

from tests.conftest import REPO, fake_devices_env

SCRIPT = textwrap.dedent(
    """
    import jax
    import numpy as np
    from flax import nnx

    from envace_jax import parallel
    from envace_jax.rl import steps
    from envace_jax.rl.config import GRPOConfig, SFTConfig
    from envace_jax.rl.optim import OptimConfig, make_optimizer
    from tests.rl_helpers import batch_with_policy_logprobs, tiny_model

    assert jax.device_count() == 8, jax.devices()
    model = tiny_model(seed=1)
    params = nnx.state(model, nnx.Param)
    batch = batch_with_policy_logprobs(
        model, np.random.default_rng(2), noise=0.2, batch_size=16, seq_len=32, num_groups=4,
        padding_rows=2,
    )
    # Adam's first update is lr * g / (|g| + eps): with the default eps 1e-8 a gradient that is
    # zero up to float rounding (~1e-9, the order of summation differs across devices) moves
    # its parameter by a sizeable fraction of lr. eps 1e-5 keeps such noise below the test's
    # tolerance while gradients well above eps are still normalised by Adam.
    tx = make_optimizer(OptimConfig(learning_rate=1e-3, eps=1e-5))
    cfg = GRPOConfig(mini_batches=2, micro_batches=2, use_kl=True, kl_coef=0.05,
                     entropy_coef=0.01)
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sh = steps.make_shardings(mesh, params, tx, batch.shape)

    def three_steps(make, shardings, *extra):
        if shardings is None:
            state, data = steps.init_train_state(params, tx), batch
        else:
            p = jax.device_put(params, shardings.params)
            state = steps.init_train_state(p, tx, shardings)
            data = steps.shard_batch(batch, shardings)
            extra = tuple(jax.device_put(e, shardings.params) for e in extra)
        step = make(model, tx, shardings=shardings)
        history = []
        for _ in range(3):
            state, metrics = step(state, data, *extra)
            history.append({k: float(v) for k, v in metrics.items()})
        return state, history

    def compare(name, make, *extra):
        one, m_one = three_steps(make, None, *extra)
        many, m_many = three_steps(make, sh, *extra)
        moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(params)))
        diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                   for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(many.params)))
        print(f"{name}: params moved {moved:.2e}, sharded vs one device {diff:.2e}")
        assert moved > 1e-3 and diff <= 1e-5, (moved, diff)
        for a, b in zip(m_one, m_many):
            for k in a:
                assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (name, k, a[k], b[k])
        return many

    ref = steps.frozen_copy(params)
    grpo = lambda m, t, shardings: steps.make_grpo_step(m, t, cfg, shardings=shardings)
    state = compare("grpo", grpo, ref)
    sft = lambda m, t, shardings: steps.make_sft_step(
        m, t, SFTConfig(micro_batches=2), shardings=shardings)
    compare("sft", sft)

    # The state really is sharded, and the step hands it back on the same shardings.
    kernel = state.params["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.sharding.spec == sh.state.params["layers"]["mlp"]["up_proj"]["kernel"].spec
    assert set(kernel.sharding.spec) >= {"fsdp", "tensor"}, kernel.sharding.spec
    mu = [x for x in jax.tree.leaves(state.opt_state) if x.shape == kernel.shape]
    assert mu and all(m.sharding.spec == kernel.sharding.spec for m in mu)
    print("OK")
    """
)


def test_sharded_steps_match_one_device(tmp_path):
    script = tmp_path / "sharded.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env=fake_devices_env(8),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "OK" in proc.stdout, out[-6000:]
    print(proc.stdout)
