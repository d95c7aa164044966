"""``pfuse export``: one network of a global artifact as a file any PyTorch user loads without this package."""

from __future__ import annotations

import json

import click

from posterior_fusion.cli.common import echo_json, handle_errors, max_memory_option, say
from posterior_fusion.errors import ConfigError


@click.command("export")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--member", default=0, show_default=True, type=click.IntRange(0, 255),
              help="Which member of the global (0-based); a distilled global has one.")
@click.option("--out", required=True, type=click.Path(dir_okay=False),
              help="The safetensors file to write (weights by the architecture's names); its model description "
                   "is written beside it as OUT.json and in the file's own metadata.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
@max_memory_option
@handle_errors
def export_cmd(file, member, out, as_json, max_memory):
    """Write one network of a global artifact as safetensors: its plain architecture's complete state_dict
    (a fine-tuned model's frozen weights put back, LoRA merged, BatchNorm statistics included) and, as JSON, the
    model spec, the input transform and the class names. Load it with `safetensors.torch.load_file` into the
    architecture you built (`model.load_state_dict(state, strict=True)`), apply the input transform to raw data,
    and take the argmax of the logits."""
    from pathlib import Path

    from safetensors.torch import save_file

    from posterior_fusion.artifact import load_global
    from posterior_fusion.files import output_lock, write_atomically, write_text_atomically
    from posterior_fusion.models.members import exported_state

    with output_lock(out, inputs=[file]):
        g = load_global(file, max_memory)
        if member >= len(g.members):
            raise ConfigError(f"--member {member}: {file} has {len(g.members)} member(s) (0 to {len(g.members) - 1})")
        state = exported_state(g.model_spec, g.members[member])
        spec = json.loads(g.model_spec.to_json())
        spec.pop("finetune", None)  # the export is the whole architecture
        described = {"format": "posterior-fusion export", "model_spec": spec, "member": member,
                     "source_sha256": g.sha256, "method": g.method,
                     "input_transform": g.metadata.get("input_transform"),
                     "class_names": g.metadata.get("class_names")}
        text = json.dumps(described, sort_keys=True)
        write_atomically(out, lambda tmp: save_file(state, str(tmp), metadata={"posterior_fusion": text}))
        write_text_atomically(Path(str(out) + ".json"), json.dumps(described, indent=2, sort_keys=True))
    if as_json:
        echo_json({"out": out, "tensors": len(state), **described})
    else:
        say(f"wrote {out}: member {member} of {file}, {len(state)} tensors ({spec['name']}); description in {out}.json")
