"""Take over fairseq's model-parallel names and its language-modelling task,
on purpose and in one place.

``import fairseq`` already registers model ``model_parallel_transformer_lm``,
archs ``transformer_lm_megatron`` / ``transformer_lm_megatron_11b`` and
criterion ``vocab_parallel_cross_entropy``, all backed by classes that need
the unreleased Megatron git submodule. The Megatron-11b recipe and checkpoints
use exactly these names, so we replace the entries instead of inventing new
ones. The ``language_modeling`` task is taken over the same way
(:mod:`fairseq_megatron.fairseq_integration.task`): a subclass that is
fairseq's task for every model but ours. fairseq's own ``register_*`` decorators cannot do that: registering a
known arch or criterion raises, and registering a known model name silently
keeps the old class.
"""

from fairseq.criterions import CRITERION_DATACLASS_REGISTRY, CRITERION_REGISTRY
from fairseq.tasks import TASK_CLASS_NAMES, TASK_REGISTRY
from fairseq.models import (
    ARCH_CONFIG_REGISTRY,
    ARCH_MODEL_INV_REGISTRY,
    ARCH_MODEL_NAME_REGISTRY,
    ARCH_MODEL_REGISTRY,
    MODEL_DATACLASS_REGISTRY,
    MODEL_REGISTRY,
    register_model,
    register_model_architecture,
)
from hydra.core.config_store import ConfigStore


def take_over_model(name: str, dataclass=None):
    """``@register_model(name)`` that replaces an existing registration.

    Arch entries pointing at the old class are re-pointed at the new one.
    """

    def decorator(cls):
        old = MODEL_REGISTRY.pop(name, None)
        MODEL_DATACLASS_REGISTRY.pop(name, None)
        registered = register_model(name, dataclass=dataclass)(cls)
        for arch, model_cls in list(ARCH_MODEL_REGISTRY.items()):
            if old is not None and model_cls is old:
                ARCH_MODEL_REGISTRY[arch] = registered
        return registered

    return decorator


def take_over_model_architecture(model_name: str, arch_name: str):
    """``@register_model_architecture(model_name, arch_name)`` that replaces an existing arch."""

    def decorator(fn):
        ARCH_MODEL_REGISTRY.pop(arch_name, None)
        ARCH_CONFIG_REGISTRY.pop(arch_name, None)
        old_model = ARCH_MODEL_NAME_REGISTRY.pop(arch_name, None)
        if old_model is not None and arch_name in ARCH_MODEL_INV_REGISTRY.get(old_model, []):
            ARCH_MODEL_INV_REGISTRY[old_model].remove(arch_name)
        return register_model_architecture(model_name, arch_name)(fn)

    return decorator


def take_over_criterion(name: str, dataclass):
    """``@register_criterion(name, dataclass)`` that replaces an existing criterion.

    Does what fairseq's ``registry.register_x`` does (registry entry, dataclass
    entry, hydra config node, the class's ``__dataclass`` attribute) without
    its duplicate-name checks; the class may keep fairseq's class name.
    """

    def decorator(cls):
        CRITERION_REGISTRY[name] = cls
        CRITERION_DATACLASS_REGISTRY[name] = dataclass
        setattr(cls, "__dataclass", dataclass)  # read back by FairseqCriterion.add_args
        node = dataclass()
        node._name = name
        ConfigStore.instance().store(name=name, group="criterion", node=node, provider="fairseq")
        return cls

    return decorator


def take_over_task(name: str, dataclass):
    """``@register_task(name, dataclass)`` that replaces an existing task with a
    subclass of it. fairseq's ``register_task`` keeps the first class
    registered under a name, silently. The dataclass (and so the config, its
    command-line options and the ConfigStore node) stays the one given,
    fairseq's own for a subclass."""

    def decorator(cls):
        TASK_REGISTRY[name] = cls
        TASK_CLASS_NAMES.add(cls.__name__)
        setattr(cls, "__dataclass", dataclass)  # what register_task sets, read back by FairseqTask.add_args
        return cls

    return decorator
