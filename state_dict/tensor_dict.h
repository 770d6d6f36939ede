// A state dict as state_dict's API takes and returns it: a TensorDict (name
// -> tensor, in module order), saved and loaded as torch.save files. The
// type and the file format are the torch.save format's
// (formats/torch_save/torch_save.h); state_dict names them here so that
// state_dict::TensorDict, state_dict::SaveTensorDict and
// state_dict::LoadTensorDict read as the rest of state_dict's API does.
#pragma once

#include "formats/torch_save/torch_save.h"

namespace state_dict {

using formats::LoadedTensorDict;
using formats::LoadIValue;
using formats::LoadOptions;
using formats::LoadTensorDict;
using formats::SaveIValue;
using formats::SaveTensorDict;
using formats::TensorDict;
using formats::TensorSource;
using formats::TensorSpec;
using formats::WriteTensorDict;
using formats::WrittenTensorDict;

}  // namespace state_dict
