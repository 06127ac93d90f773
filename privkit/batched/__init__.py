"""Many runs of one method at once: the batched engine behind an audit's reference runs.

:func:`~privkit.batched.many.train_many` dispatches to a method's batched form (the ``batched``
field of its registry entry, :class:`privkit.methods.registry.TrainerSpec`): the DP-SGD methods
stack their models' parameters on one axis (:mod:`~privkit.batched.many_dpfed`,
:mod:`~privkit.batched.many_dpsgd`, :mod:`~privkit.batched.batched_sgd`), the Adam methods run
each model's single-run kernels bit for bit (:mod:`~privkit.batched.exact_mlp`,
:mod:`~privkit.batched.many_fedavg`, :mod:`~privkit.batched.many_fedmd`). Every release noise of
a batched run is drawn by :func:`privkit.mechanisms.gaussian_release` with a leading model axis.
"""
