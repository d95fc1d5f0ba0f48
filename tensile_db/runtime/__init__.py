"""The array runtime: kernels with forward and backward, the model description (layers, losses,
optimizers), and the training program — the ordered operators of one iteration, which is also
the job's access sequence. Runs on NumPy (``cpu``) or CuPy (``cuda``) through :mod:`.device`."""
