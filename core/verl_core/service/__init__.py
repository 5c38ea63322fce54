"""A Tinker-compatible API over any engine plugin (docs/embedding.md, "A Tinker-style API").

Thinking Machines' Tinker programs training against a few primitives: ``forward_backward(data,
loss_fn)``, ``optim_step(adam_params)``, ``sample(prompt, num_samples, sampling_params)`` and saving
and loading states. ``ServiceClient`` serves them over core's engines (any backend, by name) and
rollouts, in this process, with Tinker's names and data types (``Datum``, ``ModelInput``,
``TensorData``, ``AdamParams``, ``SamplingParams``, ...), so that a Tinker loop runs against it and a
server speaking Tinker's protocol can translate each request into one call. Imports are lazy.
"""

from verl_core.lazy import lazy_exports

_EXPORTS = {
    "APIFuture": "verl_core.service.clients",
    "ServiceClient": "verl_core.service.clients",
    "TrainingClient": "verl_core.service.clients",
    "SamplingClient": "verl_core.service.clients",
    "TinkerServer": "verl_core.service.server",
    **{
        name: "verl_core.service.types"
        for name in (
            "AdamParams",
            "Datum",
            "EncodedTextChunk",
            "ForwardBackwardOutput",
            "GetInfoResponse",
            "GetServerCapabilitiesResponse",
            "LoadWeightsResponse",
            "ModelData",
            "ModelInput",
            "OptimStepResponse",
            "SampleResponse",
            "SampledSequence",
            "SamplingParams",
            "SaveWeightsForSamplerResponse",
            "SaveWeightsResponse",
            "SupportedModel",
            "TensorData",
        )
    },
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
