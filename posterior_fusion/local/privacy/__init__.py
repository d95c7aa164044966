"""Differentially private client artifacts (``fit-local --dp-epsilon E``): every quantity of the release that
depends on the silo's data goes through a mechanism, and one accountant composes them into the (ε, δ) asked
for. Under add/remove-one-sample neighbouring:

- **training** of each of the M components: DP-SGD through Opacus (per-sample gradients of a
  ``GradSampleModule``, each clipped to ``dp_clip`` in L2, Gaussian noise of standard deviation
  ``noise_multiplier · clip`` on their sum, batches drawn by Poisson sampling at rate q = batch / n); the
  weight decay toward the prior's centre is data-independent and applied after each noisy step;
- **curvature**, structure ``diag``: each sample's contribution to the exact GGN diagonal,
  ``c_n = Σ_r (J_nᵀ s_nr)²`` (s_nr the columns of a square root of the cross-entropy Hessian), is clipped to
  ``dp_curvature_clip`` in L2, so adding or removing a sample moves the sum by at most ``dp_curvature_clip`` (its
  L2 sensitivity); Gaussian noise of standard deviation ``release_noise · curvature_clip`` on every
  coordinate; negative values set to 0 (post-processing). One release per component;
- **curvature**, structure ``kron`` (:func:`~posterior_fusion.local.capture.private.private_kron`): each sample's contributions to every layer's input
  factor (``A_n = X_n X_nᵀ / S`` expand, ``ū_n ū_nᵀ`` reduce; X_n its input patches over the S shared
  positions) are scaled together to Frobenius norm at most ``dp_input_clip``, its contributions to every output
  factor (``B_n = Σ_r G_nr G_nrᵀ`` over the C − 1 columns of the exact GGN) and to the normalisation layers'
  diagonals together to at most ``dp_curvature_clip``; the factors are summed unnormalised (dividing by n, a
  quantity of the data, would couple every entry to one sample), so adding or removing one sample moves the two
  parts by at most their clips. The Gaussian mechanism on both parts at once (sensitivity √2 in units of the
  clips: noise ``release_noise · √2 · clip`` on every entry of each factor's upper triangle, mirrored), each
  factor made positive semi-definite, the input factors divided by the released n (post-processing). One release
  per component;
- **curvature**, structure ``diag+full`` (:func:`~posterior_fusion.local.capture.private.private_diag_full`): each sample's contribution to the GGN
  diagonal of every parameter but the last ``nn.Linear``'s, ``c_n``, and to that layer's full block,
  ``G_n = H_n ⊗ φ̃_n φ̃_nᵀ`` (``H_n`` the cross-entropy Hessian at its logits, ``φ̃_n`` the layer's input with a 1
  for the bias; ``‖G_n‖_F = ‖H_n‖_F ‖φ̃_n‖²``), are scaled together to ``√(‖c_n‖² + ‖G_n‖_F²) ≤ dp_curvature_clip``;
  the released entries — the diagonal and the block's upper triangle, whose L2 norm is at most that — move by at
  most the clip. Gaussian noise ``release_noise · curvature_clip`` on each, mirrored; the diagonal floored at 0
  and the block made positive semi-definite (post-processing). One release per component;
- **class counts**: the histogram with Gaussian noise of standard deviation ``release_noise`` (sensitivity 1),
  rounded and floored at 0 (post-processing); ``n_data`` is their sum;
- **SWAG moments** (``swag``): the running moments of DP-SGD's own iterates, post-processing of the training's
  release (its guarantee covers every iterate): no further ε;
- **FedPPD** (``ppd``, :func:`~posterior_fusion.local.privacy.training.private_ppd`): the SGLD chain's gradient and the student's distillation step each
  through Opacus on their own Poisson batches at ``ppd_batch_size / n`` (two more passes of subsampled Gaussian
  steps at the training's noise multiplier, recorded under ``passes``);
- **a local model** (``local_model``, HBFL): trained by DP-SGD as one more pass; its probabilities on each
  sample enter only that sample's loss in the shared model's DP-SGD, clipped with it;
- everything else the artifact holds is post-processing of these or data-independent (the MAPs, the
  temperature and prior, the input transform, the model); the data's SHA-256 and the training loss and
  accuracy are not recorded.

The accountant: Rényi DP (Opacus' ``compute_rdp``) of the subsampled Gaussian for all training steps and other
gradient passes plus the M + 1 full-batch Gaussian releases, converted to (ε, δ) once. ``dp_training_share`` of
ε calibrates the one noise multiplier of every gradient pass (at δ/2) and the rest the releases (at δ/2); both
noises are then scaled down together as far as the composed ε stays within the target; that composed ε is
recorded. The silo's size n sets the sampling rates (batch / n, as Opacus' Poisson sampler does) and the default
δ = 1/n: the accounting treats n as public; the class histogram, whose sum is the released ``n_data``, is not.

Every gradient noise is drawn from a generator seeded from the operating system's entropy, never from the
recorded training seed.

The modules: :mod:`.accounting` (the noise calibration and the accountant), :mod:`.training` (DP-SGD, the
refresh round's private gradients, private FedPPD) and :mod:`posterior_fusion.local.capture.private` (the
private curvature releases).
"""
