"""Publishing a drafter directory to the Hugging Face Hub: validate it, write its model card, upload it.

Why each step is here:
  * validation runs before any network call, because a bad drafter on the Hub is served by other
    people's engines: the layout must be the one recycle.json declares (the drafter class loads it
    strictly, every safetensors header equals the mapping table convert wrote), weights finite;
  * the card is generated from recycle.json (provenance, mapping), bench.json (measured τ and
    speedup) and the format's serving commands, so what is published says how it was made;
  * the upload is one `create_commit` after `create_repo`/`create_branch`: files are pre-uploaded
    first and the commit call is the only step that changes the repository, so a failure at any
    earlier point leaves nothing. (`upload_folder` in huggingface_hub ≥ 1.x with hf_xet splits a
    large folder into several "(part N)" commits, and it cannot add the generated README.md without
    writing into the input directory, so it is not used.)
The token is resolved by huggingface_hub (HF_TOKEN, then the saved login) and only ever handed to
HfApi; nothing here prints, logs or writes it. The endpoint follows HF_ENDPOINT at call time.

The three steps live in their own modules: `validate` (before any network call), `card` (the model card),
`upload` (the one commit).
"""

from __future__ import annotations

from recycle.hub.card import base_model_name, build_card, source_name
from recycle.hub.upload import hub_endpoint, push_drafter
from recycle.hub.validate import Drafter, validate_drafter

__all__ = ["Drafter", "validate_drafter", "base_model_name", "build_card", "source_name", "push_drafter",
           "hub_endpoint"]
