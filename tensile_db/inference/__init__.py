"""Demand-layered batch inference on the coordinator (Ji et al., "Demand Layering for Real-Time
DNN Inference with Minimized Memory Usage", arXiv 2210.04024).

A served model's weights are in a file on disk, one per version (``files``); each node of the
network that holds weights (a dense layer, a convolution, a batch normalisation) is one read-only
tensor of the memory manager, read from its file into the arena shortly before it runs and given
up after, so a call needs the device memory of a few layers and one batch's live activations, not
of the whole model, and no host memory for the model's layers. ``files`` writes and reads the
model files, ``store`` holds the served models, ``layered`` runs one call through them with a
prefetch window, ``service`` is what the coordinator's connections call.
"""

#: Job id under which the memory manager counts every inference tensor (layers and activations).
INFERENCE_JOB = -1
