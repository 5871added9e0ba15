"""`rl.resolve`: the ConfigDict becomes frozen typed sections once, at start-up."""

import dataclasses
import importlib.util
import os

import pytest
from conftest import ROOT, load_config

from rlscale import checkpoint, optim, sections, stage_cache
from rlscale.data import filters
from rlscale.rl import run_config, setup


def test_resolve_lists_problems_of_every_section_at_once_naming_their_keys():
    c = load_config("quickstart")
    c.batch.group_size = 0
    c.learner.remat = "dot"
    c.optim.schedule = "linear"
    c.checkpoint.keep = 0
    c.pipeline.decode_chunk = 0
    c.eval.every = 0
    c.steps = 0
    with pytest.raises(sections.InvalidConfigError) as e:
        run_config.resolve(c)
    text = str(e.value)
    assert text.startswith("Invalid config:\n  ")
    for problem in (
        "batch.group_size=0 must be >= 1",
        "learner.remat='dot' is not one of ('none', 'dots', 'full')",
        "optim.schedule='linear' is not 'constant' or 'cosine'",
        "checkpoint.keep=0 must be an integer >= 1",
        "pipeline.decode_chunk=0 must be an integer >= 1",
        "eval.every=0 must be an integer >= 1",
        "steps=0 must be an integer >= 1",
    ):
        assert problem in e.value.problems, (problem, text)


def test_unknown_key_in_a_section_is_a_problem():
    c = load_config("quickstart")
    with c.unlocked():
        c.filters.zero_varianse = True
    with pytest.raises(ValueError, match=r"filters: unknown keys \['zero_varianse'\]"):
        run_config.resolve(c)


def test_derived_defaults_are_filled_once():
    c = load_config("quickstart")  # pipeline.slots = 0.
    assert (c.pipeline.slots, c.batch.prompt_pool) == (0, 0)
    run = run_config.resolve(c)
    assert run.batch.samples_per_prompt == c.batch.group_size
    assert run.pipeline.slots == c.batch.prompts * c.batch.group_size
    assert run.batch.with_pool(c.task.n_train).prompt_pool == c.task.n_train
    with pytest.raises(ValueError, match="batch.prompt_pool=9 is more than the task's 4"):
        dataclasses.replace(run.batch, prompt_pool=9).with_pool(4)
    c.pipeline.slots = 64  # A set value stays.
    assert run_config.resolve(c).pipeline.slots == 64
    # A preference run that samples its pairs samples preference.samples per prompt.
    run = run_config.resolve(load_config("iterative_dpo", None))
    assert run.batch.samples_per_prompt == run.preference.samples != run.batch.group_size
    assert run.pipeline.slots == run.batch.prompts * run.preference.samples


def test_sections_are_frozen_typed_and_check_themselves():
    run = run_config.resolve(load_config("quickstart"))
    assert isinstance(run.optim, optim.OptimConfig)
    assert isinstance(run.filters, filters.FilterConfig)
    assert isinstance(run.checkpoint, checkpoint.CheckpointConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.batch.prompts = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.batch = None
    with pytest.raises(AttributeError, match="immutable"):  # The raw config is frozen too.
        run.raw.steps = 3
    with pytest.raises(ValueError, match="learner.logprob_chunk=0 must be an integer >= 1"):
        setup.LearnerConfig(logprob_chunk=0)
    assert run.to_dict()["batch"]["prompts"] == run.batch.prompts  # As given, for checkpoints.


def _configs():
    """Every config file with and without `smoke`, and every variant the objectives' tests
    run (`test_objectives.VARIANTS`)."""
    from test_objectives import VARIANTS

    out = []
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".py") and not name.startswith("_"):
            out += [(name[:-3], arg) for arg in (None, "smoke")]
    return out + [v for v in VARIANTS if v not in out]


def _get_config(name, arg):
    path = os.path.join(ROOT, "configs", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"resolve_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        return module.get_config(arg)
    except ValueError:  # A config without a `smoke` variant.
        return None


@pytest.mark.parametrize("name,arg", _configs())
def test_every_config_resolves_or_names_only_what_lies_outside_it(name, arg):
    """Every recipe resolves; a config that needs what its command line names (the files
    task's files, a reward model, a teacher) fails only on those, naming them."""
    c = _get_config(name, arg)
    if c is None or c.get("recipe") == "demo":
        return
    try:
        run_config.resolve(c)
    except sections.InvalidConfigError as e:
        outside = (
            "task.files",
            "reward.model=",
            "reward.prm=",
            "init.hf_checkpoint=",
            "objective.chain reads teacher_logp (distill_advantage) but teacher.checkpoint is",
        )
        assert all(p.startswith(outside) for p in e.problems), e.problems


def test_a_reward_models_pairs_follow_the_samples_they_are_formed_from():
    """`reward.model='train_at_setup'` forms its pairs from the RL generator's groups
    (`batch.group_size` per prompt), not `preference.samples` (a preference run's count): the
    pairs' and reward model's stage settings follow the first and ignore the second."""

    def made(**batch_and_preference):
        c = load_config("rm_rl")
        for key, value in batch_and_preference.items():
            section, name = key.split("__")
            c[section][name] = value
        settings = setup.stage_settings(run_config.resolve(c))
        return [settings[s] for s in (stage_cache.PREFERENCE_PAIRS, stage_cache.REWARD_MODEL)]

    base = made()
    assert base[0]["samples_per_prompt"] == load_config("rm_rl").batch.group_size
    assert made(batch__group_size=6) != base
    assert made(preference__samples=6) == base
