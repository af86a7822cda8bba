# Converts a tests/fixtures/hf-families-2026 folder to GGUF with llama.cpp's own
# converter (convert_hf_to_gguf.py), unchanged but for two things:
#
# - the fixtures' 512-token test tokenizer is unknown to the converter's
#   pre-tokenizer hash table, which refuses it, so its pre-tokenizer is named
#   "qwen2" (it is a Qwen2-style byte-level BPE);
# - Gemma 3: the converter drops `layer_types`, and llama.cpp's loader then
#   takes every 6th layer as global. The gemma3 fixture's 3 layers are
#   (sliding, sliding, full), so the wrapper also writes the per-layer
#   `gemma3.attention.sliding_window_pattern` (bools, true = local) that
#   llama.cpp's loader reads before falling back to 6. Without it the file
#   would mean another model (all three layers local).
#
# This wrapper exists only for that.
#
# usage: python scripts/convert-hf-to-gguf-fixture.py LLAMA_CPP_DIR HF_FOLDER \
#            --outtype f32 [--no-mtp] --outfile OUT.gguf
import runpy
import sys

D = sys.argv.pop(1)
sys.path[:0] = [D, D + "/gguf-py"]
import conversion.base as base  # noqa: E402
import conversion.gemma as gemma  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tok: "qwen2"

_gemma3_params = gemma.Gemma3Model.set_gguf_parameters


def _gemma3_with_layer_types(self):
    _gemma3_params(self)
    types = self.hparams.get("layer_types")
    if types is not None and self.hparams.get("sliding_window"):
        self.gguf_writer.add_sliding_window_pattern(
            [t == "sliding_attention" for t in types]
        )


gemma.Gemma3Model.set_gguf_parameters = _gemma3_with_layer_types
sys.argv[0] = D + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
