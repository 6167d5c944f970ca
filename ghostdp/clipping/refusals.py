"""What the step's graph audit (audit.py) refuses, in words about the attached model: a trainable parameter with a
gradient hook of its own, gradient outside every recorded call of a parameter's module (stray), past a fallback call's
outputs (uncounted), through a frequency-scaled embedding lookup, or into a parameter the model did not have when it
was made private (foreign). Each error names the parameters (by name in the model, else by shape), the cause and the
fix; the stray refusal also names the modules validate.fix would swap for their twins (layers/twins.py) and DeBERTa's
position embeddings shared by the batch (layers/deberta.py)."""
from __future__ import annotations

from ..layers import deberta
from ..layers import twins
from .probe import compiled_code_note
from .reentrant import USE_NON_REENTRANT
from .repeated import repeated_by_its_caller

IN_A_REENTRANT_REGION = (
    "This gradient arose inside a reentrant activation checkpoint, whose forward ghostdp sees only as its backward "
    "recomputes it: a module's own parameters that its forward applies by elementwise ops (layer scales, a class "
    "token: norms/parameter_uses.py) are captured only in an ordinary forward. Fix: " + USE_NON_REENTRANT)


def listed(names, shown=5, quoted=True) -> str:
    """The first ``shown`` names (quoted), and how many there are where there are more."""
    written = ", ".join(f"'{n}'" if quoted else n for n in names[:shown])
    return written + (f", ... ({len(names)})" if len(names) > shown else "")


class AuditRefusals:
    """The audit's refusals for one attached model. ``refused_twins``: its modules without a rule that have a twin
    (validate.fix swaps them in); ``shared_by_the_batch``: DeBERTa's relative embeddings that the whole batch reads."""

    def __init__(self, module, refused_twins: list, shared_by_the_batch: list):
        self.module = module
        self.refused_twins = refused_twins
        self.shared_by_the_batch = shared_by_the_batch

    def refuse(self, found, calls, nothing_live: bool = False):
        """Raise for what the graph audit found wrong (audit.GraphAudit), if anything: stray, uncounted, frequency-
        scaled or foreign. ``calls``: the step's recorded calls, for the stray refusal's message (True in a
        reentrant region, where the step recorded some); ``nothing_live``: no recorded use of a trained parameter
        waits for pass 1 (with no call either, nothing of this forward was recorded)."""
        if found.stray:
            self._stray(found.stray, calls, nothing_live)
        if found.uncounted:
            self._uncounted(found.uncounted)
        if found.frequency_scaled:
            self._frequency_scaling(found.frequency_scaled)
        if found.foreign:
            self._foreign(found.foreign)

    def described(self, params) -> str:
        """The parameters by their names in the model (by shape where they have none), quoted, for an error."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return ", ".join(f"'{names.get(id(p), tuple(p.shape))}'" for p in params)

    def refuse_gradient_hooks(self, trainable: dict, others_hooks) -> None:
        """Refuse a trainable parameter with a gradient hook of its own (``register_hook``,
        ``register_post_accumulate_grad_hook``): the norms of pass 1 never see what it does to the gradient,
        so in two passes it changes the clipped sum after clipping (a hook that scales it by 10^4 took the
        update 10^4 times past C), and book-keeping, which writes p.grad itself, never runs it. ``others_hooks(p)``:
        whether p has an accumulation hook that is not ghostdp's (AccumulationWatch)."""
        hooked = [p for p in trainable.values() if p._backward_hooks or others_hooks(p)]
        if not hooked:
            return
        described = self.described(hooked[:5])
        raise RuntimeError(
            f"the trainable parameter(s) {described} have a gradient hook (Tensor.register_hook or "
            "register_post_accumulate_grad_hook). ghostdp bounds each example's gradient before any such hook "
            "runs, so a hook that changes the gradient would move the update past the clipping norm (two "
            "passes), and book-keeping, which writes p.grad itself, would skip it silently. Fix: remove the "
            "hook (handle.remove()); to train only some rows of a parameter, freeze it and train a separate "
            "parameter for those rows, or zero their update after optimizer.step().")

    def _stray(self, stray, calls, nothing_live):
        """Raise for parameters with gradient edges outside every recorded call of their modules."""
        unrecorded = not calls and nothing_live
        if unrecorded and not self.module.training:
            raise RuntimeError(
                "no call of a trainable layer was recorded for this loss: the forward ran with the model in "
                "eval() mode (ghostdp records only in train mode). Fix: call model.train() before the forward of "
                "a training step." + compiled_code_note())
        # In train mode with nothing recorded: every trained parameter is read outside its module's call (peft's
        # Lily: the layers read their lily_B's weight without calling it), or the forward ran before attaching.
        described = self.described(stray)
        names = {id(p): n for n, p in self.module.named_parameters()}
        in_twins = sorted({w for p in stray for w in self.refused_twins if names.get(id(p), "").startswith(w + ".")})
        shared = [n for n in self.shared_by_the_batch if n in {names.get(id(p)) for p in stray}]
        raise RuntimeError(
            f"gradient reaches the parameter(s) {described} outside the forward of the module that owns "
            "it (e.g. a parent reads child.weight directly, on every step or only for some inputs, or the loss "
            "adds a penalty on the weights), so ghostdp cannot bound its per-example norm. Fix: call the owning "
            "module instead of reading its parameter, freeze the parameter, or register a norm rule for the "
            "parent module; for a weight penalty (L2), use the optimizer's weight_decay, which acts on the "
            "weights and not on the data."
            + (" " + self.twins_fix(in_twins) if in_twins else "")
            + (" " + deberta.SHARED.format(names=listed(shared)) if shared else "")
            + (" " + IN_A_REENTRANT_REGION if calls is True else "")
            + (" No call of a trainable layer was recorded at all: if this forward ran before the controller was "
               "attached, run it again after attaching." if unrecorded else "") + compiled_code_note())

    def twins_fix(self, names) -> str:
        """layers/twins.py's REFUSED for these modules of the model, each of a class with a twin."""
        return twins.REFUSED.format(names=listed(names), why=twins.why_refused(self.module, names))

    def _uncounted(self, uncounted):
        """Raise for parameters of modules without a rule that a gradient path reaches past every call's outputs
        (fallback_paths.py)."""
        _, call = uncounted[0]
        described = self.described([p for p, _ in uncounted[:5]])
        if repeated_by_its_caller(call):  # captured at the model's repeat of its shared output (repeated.py)
            raise RuntimeError(
                f"gradient reaches the parameter(s) {described} of module '{call.name}' ({type(call.module).__name__}, "
                "the prompt of peft's prompt tuning or p-tuning) along a path that does not go through the model's "
                "repeat of the prompt to the batch, where ghostdp takes its per-example gradients: the prompt (or "
                "a tensor computed from it) was kept and used after the forward, so that part of each example's "
                "gradient would escape clipping. Fix: use the prompt only through the model's forward (or detach() "
                "what is kept).")
        raise RuntimeError(
            f"gradient reaches the parameter(s) {described} of module '{call.name}' ({type(call.module).__name__}), "
            "which has no norm rule, along a path that does not go through the outputs its forward returned: a "
            "tensor computed inside its forward was kept (on the module, or in an output container that is not a "
            "tuple, list or dict) and used after the forward. ghostdp takes such a module's per-example gradients "
            "from its returned outputs, so that part of each example's gradient would escape clipping. Fix: use "
            "the value the forward returns (return the kept tensor too, as part of a tuple or dict), pass it to "
            "the next call as an argument, or detach() what is kept; or register a norm rule for the module "
            "(ghostdp.register_norm_rule).")

    def _foreign(self, params):
        """Raise for nn.Parameters that get gradient from the DP loss but are not the attached model's
        (audit.GraphAudit.foreign)."""
        named = self.described(params[:5])  # by name where the model holds them now, else by shape
        raise RuntimeError(
            f"the parameter(s) {named} get gradient from the DP loss but were not parameters of the model when it "
            "was made private (a module added or replaced afterwards, e.g. a new classification head, or a "
            "parameter held outside the model, e.g. a learned temperature): no per-example norm counts them, so "
            "two passes would give them an unclipped gradient and book-keeping none. Fix: make every trained "
            "parameter part of the model before make_private / GhostClipping (or make it private again), or "
            "freeze or detach the others.")

    def _frequency_scaling(self, lookups):
        """Raise for embedding lookups whose backward scales by index counts over the batch (audit.frequency_scaled)."""
        tables = {id(t): t for t in (getattr(node.next_functions[0][0], "variable", None) for node in lookups)
                  if t is not None}
        tables = list(tables.values())
        into = f" of {self.described(tables[:5])}" if tables else ""
        raise RuntimeError(
            f"an embedding lookup scales the gradient{into} by how often each index occurs in the whole batch "
            "(F.embedding, F.embedding_bag or nn.EmbeddingBag with scale_grad_by_freq=True): each example's gradient "
            "then depends on the other examples' indices, so one example changes the others' clipped gradients and "
            "can move the update by more than the clipping norm. Fix: scale_grad_by_freq=False.")
