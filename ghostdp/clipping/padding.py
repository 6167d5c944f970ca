"""Whether each example's outputs depend on how far the batch is padded.

With dynamic padding (a collator pads each batch to its longest example, as transformers'
DataCollatorWithPadding does) the number of positions T belongs to the batch: an added long example pads every
other example further. A model that reads padded positions its attention mask excludes (a mean over all
positions, ``h.mean(1)``, instead of over the unmasked ones) then gives each example a gradient that depends on
the others' lengths: one added example of length 48 moved the clipped sum of 8 others by 1.8 C (a 2-layer BERT
with such a head, float64), besides its own C, and no check saw it before 2026-11-26.

So the forward check (independence.py) reruns, on its schedule, a forward called with an ``attention_mask`` of shape
(B, T) (transformers' convention; by keyword or by position) twice more without gradient and in eval() mode (dropout
would draw other masks for longer tensors): on the batch, and on the batch padded by EXTRA more positions
(``padded_arguments``). Each output's values at the batch's real positions (``at_real_positions``) must not move. A
forward that cannot take EXTRA more positions (more than the model has) is padded by one; one that cannot take that
either goes unchecked for padding on that step. A model found to move is refused only once the training forwards'
lengths have differed: padded to one fixed length (padding="max_length"), T is no property of the batch. The
check compares the model's outputs; the loss after them is checked where ghostdp forms it: DPTrainer's token losses
count only the positions the mask keeps, and a DP criterion called without a mask refuses targets that count padded
positions (``counted_padding``, on the checked forwards). The mask is found by its name (MASK_NAMES: transformers'
attention_mask, and since 2026-12-03 torch's src_key_padding_mask and key_padding_mask, True at padding:
before, a model of torch's nn.TransformerEncoder layers given a key padding mask went unchecked, and its mean over
all positions trained), by keyword, by position in the forward's signature, or inside an argument (a batch dict's
key, a SimpleNamespace's or a dataclass's attribute, since 2026-12-03; before, a model given its batch as one dict
went unchecked for padding, its mean over padded positions trained). Not covered: losses of one's own that read
padded positions, forwards without such an argument. Sequence-first batches ((T, B, ...) beside a (B, T) mask) are
padded on dim 0 (since 2026-12-03; not where T = B). transformers' BERT, RoBERTa,
DistilBERT, ALBERT, ELECTRA, Funnel, GPT-2 and Llama (sdpa and eager, right and left padding, float32 and bfloat16;
CPU) move by at most 0.0039 of their size in bfloat16 (the floor there: 0.0625), 2e-7 in float32.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref

import torch

from .leaves import flatten_with_paths, unflatten

LABELS_IGNORED = -100  # transformers' ignore index: a padded label position is not a target
EXTRA = 8  # positions added: a mean over T + 8 positions instead of T moves far beyond rounding

DEPENDS_ON_PADDING = (
    "the model's outputs depend on how far the batch is padded: padding the batch of {batch} examples (length "
    "{length}) by {extra} more positions, masked out, moved {output} at the real positions by "
    "{moved:.3g} of its size (beyond {threshold:.3g}, what rounding allows; eval() mode, no gradient), and the "
    "batches' lengths differ ({lengths}): each batch is padded to its longest example, so one "
    "example's length moves the others' outputs and clipped gradients, and one example can move the update by "
    "more than the clipping norm (measured: 1.8 C besides its own). Something reads positions that the attention "
    "mask excludes: a mean or sum over all positions (h.mean(1)), a pooling window across the padding. Fix: use "
    "the mask where the model pools ((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)), or pad every batch "
    "to one fixed length (tokenizer(..., padding='max_length', max_length=...)). If you are sure the move is "
    "rounding, or that your loss reads none of the outputs that moved, switch this check off with "
    "controller.independence.check_padding = False (engine.controller after make_private, trainer.controller "
    "in DPTrainer).")


COUNTS_PADDING = (
    "the loss counts positions that the batch's attention mask excludes: the target has padded positions (attention "
    "mask 0) that are not the criterion's ignore_index ({ignore}), such as labels copied from the padded input ids. "
    "Each example's loss then depends on how far its batch is padded, and with batches padded to their longest "
    "example one example's length moves the others' clipped gradients (measured: 5.3 C, a 2-layer GPT-2 whose "
    "causal LM labels were the padded input ids). Fix: pass the mask, criterion(output, target, attention_mask) "
    "(only its positions count), or set the target's padded positions to -100 (the ignore_index).")


def counted_padding(criterion, target: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether an elementwise loss of ``criterion`` on ``target`` counts a position that ``mask`` (B, T) excludes:
    a target laid out as the mask ((B, T, ...)), or one position shorter (a causal LM's targets, shifted: against
    the mask's last T - 1 positions), with a padded position that is not the criterion's ignore_index (a float
    target: any padded position)."""
    if target.dim() < 2 or target.shape[0] != mask.shape[0]:
        return False
    if target.shape[1] == mask.shape[1] - 1:
        mask = mask[:, 1:]
    elif target.shape[1] != mask.shape[1]:
        return False
    padded = mask == 0
    ignore = getattr(criterion, "ignore_index", None)
    if not target.is_floating_point() and target.dim() == 2 and ignore is not None:
        padded = padded & (target != ignore)
    return bool(padded.any())


def _parameter_names(forward) -> tuple:
    """The names of the positional parameters of a bound ``forward`` (empty where it has no signature)."""
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


_NAMES = weakref.WeakKeyDictionary()  # module class -> the positional parameter names of its forward


def _argument(module, args, kwargs, name: str):
    """The forward's argument ``name``, by keyword or by its position in the forward's signature, or None."""
    if name in kwargs:
        return kwargs[name]
    names = _positional_names(module)
    index = names.index(name) if name in names else len(args)
    return args[index] if index < len(args) else None


def _positional_names(module) -> tuple:
    """The names of the positional parameters of the module's forward. A DDP (or DataParallel) wrapper passes its
    arguments on: the signature is the wrapped module's."""
    while isinstance(module, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        module = module.module
    names = _NAMES.get(type(module))
    if names is None:
        names = _NAMES[type(module)] = _parameter_names(module.forward)
    return names


# The masks looked for, by name: transformers' attention_mask (1 or True where a position is real, 0 at padding), and
# torch's key padding masks (nn.TransformerEncoder's src_key_padding_mask, nn.MultiheadAttention's key_padding_mask;
# boolean, True at padding), each with the value it takes at an added position. Not "padding_mask", which some of
# transformers' models take (Encodec, PE Audio, Moonshine, VITS) and Encodec's means True at the real positions.
MASK_NAMES = {"attention_mask": 0, "src_key_padding_mask": True, "key_padding_mask": True}


def _mask_argument(module, args, kwargs):
    """(the forward's mask argument, its value at padding) for the first of MASK_NAMES found (by keyword or position;
    else inside an argument, a batch dict's or a SimpleNamespace's: _named) as a (B, T) tensor, integer or boolean
    (torch's: boolean), else None."""
    inside = None
    for name, padding in MASK_NAMES.items():
        mask = _argument(module, args, kwargs, name)
        if mask is None and not all(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            inside = _named(module, args, kwargs) if inside is None else inside
            mask = next((t for found, t in inside if found == name), None)
        if (isinstance(mask, torch.Tensor) and mask.dim() == 2 and not mask.is_floating_point()
                and (padding == 0 or mask.dtype == torch.bool)):
            return mask, padding
    return None


def _key_padding(name, t) -> bool:
    """Whether ``t`` is a torch key padding mask by its name and dtype (True at padding: padded with True)."""
    return isinstance(name, str) and name.endswith("key_padding_mask") and t.dtype == torch.bool


def attention_mask(module, args, kwargs) -> torch.Tensor | None:
    """The forward's mask (_mask_argument) as transformers has it, nonzero at the real positions: a key padding
    mask (True at padding) negated; or None."""
    found = _mask_argument(module, args, kwargs)
    return None if found is None else _real_positions(*found)


def _real_positions(mask, padding) -> torch.Tensor:
    """A mask of _mask_argument, nonzero at the real positions (``padding``: its value at padding)."""
    return mask if padding == 0 else ~mask


def _named(module, args, kwargs, flat=None) -> list:
    """(name, leaf) of each leaf of the forward's arguments (leaves.flatten_with_paths, or its ``flat``): the last
    key of its path (a dict's key, an attribute), or for a positional argument its name in the forward's signature;
    None for a list's items."""
    paths, leaves, _ = flatten_with_paths((args, kwargs)) if flat is None else flat
    names = _positional_names(module)
    named = []
    for path, leaf in zip(paths, leaves):
        key = path[-1]
        if len(path) == 2 and path[0].idx == 0:  # a positional argument itself
            named.append((names[key.idx] if key.idx < len(names) else None, leaf))
        else:
            named.append((getattr(key, "key", getattr(key, "name", None)), leaf))
    return named


def _pad_id(module, input_ids: torch.Tensor | None, mask: torch.Tensor):
    """The id the batch was padded with (read at a masked position), else the model's config.pad_token_id; None
    where neither says (a sequence classifier finds each example's last token by it: another id would move it)."""
    if input_ids is None:
        return 0
    masked = input_ids[mask == 0]
    if masked.numel():
        return int(masked[0])
    for m in module.modules():
        pad = getattr(getattr(m, "config", None), "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return None


def padded_arguments(module, args, kwargs, batch: int, extra: int = EXTRA, sequence_first: bool = False):
    """(args, kwargs) with every tensor of leading shape (batch, T) padded by ``extra`` positions on dim 1
    (the mask with its value at padding, another boolean ``*key_padding_mask`` with True, labels with -100, the input
    ids with the pad id, others with 0), and T; or
    None where the forward has no mask of MASK_NAMES of shape (batch, T) or the pad id is unknown. A
    ``sequence_first`` batch (its examples on dim 1: independence.py) has its tensors of leading shape (T, batch)
    padded on dim 0 (the mask stays (B, T), as torch's Transformer takes it); None where T = batch (which is which?)."""
    found = _mask_argument(module, args, kwargs)
    if found is None or found[0].shape[0] != batch:
        return None
    given, padding = found
    mask = _real_positions(given, padding)
    length = mask.shape[1]
    if sequence_first and length == batch:
        return None
    flat = flatten_with_paths((args, kwargs))
    named = _named(module, args, kwargs, flat)

    def positions_dim(t) -> int | None:
        """The dim of ``t`` that holds the mask's positions, where ``t`` is laid out as the batch (else None)."""
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            return None
        if t.shape[:2] == mask.shape:
            return 1
        return 0 if sequence_first and t.shape[:2] == mask.shape[::-1] else None

    def like_the_ids(t):
        return (positions_dim(t) is not None and t is not given and not t.is_floating_point()
                and t.dim() == 2)

    ids = next((t for name, t in named if name == "input_ids" and like_the_ids(t)), None)
    if ids is None:  # the first positional argument of the mask's shape, as before; then any other but labels
        ids = next((a for a in args if like_the_ids(a)), None)
    if ids is None:
        ids = next((t for name, t in named if name != "labels" and like_the_ids(t)), None)
    pad_id = _pad_id(module, None if ids is None else ids if positions_dim(ids) == 1 else ids.t(), mask)
    if pad_id is None:
        return None

    def padded(name, t):
        dim = positions_dim(t)
        if dim is None:
            return t
        if t is given:
            fill = padding
        elif _key_padding(name, t):  # another key padding mask of the batch's length (a decoder's)
            fill = True
        else:
            fill = 0 if t.is_floating_point() else LABELS_IGNORED if name == "labels" else pad_id if t is ids else 0
        added = list(t.shape)
        added[dim] = extra
        return torch.cat([t, t.new_full(added, fill)], dim)

    return unflatten([padded(name, t) for name, t in named], flat[2]), length


def at_real_positions(leaves, original, length: int, mask: torch.Tensor) -> list:
    """Each output narrowed to its ``original`` shape ((key path, shape or None) per leaf) along the dims after the
    first that grew from ``length`` (positions, and both of an attention map's; None where the shapes differ
    otherwise), and zero at the positions the attention mask excludes along every dim of that length (the mask's
    first rows: a batch without its last example has fewer): what a model computes there (a causal model's fully
    masked rows under left padding average over all positions) reaches no loss that ignores padding."""
    out = []
    for (_, p), (_, shape) in zip(leaves, original):
        if not isinstance(p, torch.Tensor) or shape is None or p.dim() != len(shape):
            out.append(None)
            continue
        for dim in range(1, p.dim()):
            a, b = p.shape[dim], shape[dim]
            if a != b:
                if not (b == length and a > length):
                    p = None
                    break
                p = p.narrow(dim, 0, length)
        if p is not None and p.dim() > 1 and p.shape[0] <= mask.shape[0]:
            rows = mask[:p.shape[0]]
            for dim in range(1, p.dim()):
                if p.shape[dim] == length:
                    shape = [rows.shape[0]] + [length if d == dim else 1 for d in range(1, p.dim())]
                    p = torch.where(rows.reshape(shape).bool(), p, 0)  # a NaN there (a row with no key) too
        out.append(p)
    return out


@contextlib.contextmanager
def in_eval_mode(module):
    """``module`` and its submodules in eval() mode inside; each gets its own flag back after."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag
