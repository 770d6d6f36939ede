// Member bindings of the stock torch::nn modules that hold parameters or
// buffers: for each, the fields its forward() reads. Modules without tensors
// of their own (activations, pooling, dropout, containers, Transformer
// layers, ...) need none; their children are reached by recursion.
// member_binding_coverage in named_member_accessor_test constructs every one
// of these types and checks that each registry entry is bound.
#include "functorch/module/internal/member_binding_registry.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/parameterdict.h>
#include <torch/nn/modules/container/parameterlist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/loss.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/modules/rnn.h>

namespace functorch {
namespace internal {
namespace {

using torch::Tensor;
namespace nn = torch::nn;

// RNN/LSTM/GRU forward() passes RNNImplBase::flat_weights_ (protected) to
// the ATen kernel; entry i belongs to flat_weights_names_[i]. A derived
// struct may form pointers to those protected members.
template <typename Derived>
struct RnnWeightsAccess : nn::detail::RNNImplBase<Derived> {
  using Base = nn::detail::RNNImplBase<Derived>;
  static void visit(Derived& module, const MemberHandleVisitor& visit) {
    Base& base = module;
    auto& names = base.*(&RnnWeightsAccess::flat_weights_names_);
    auto& weights = base.*(&RnnWeightsAccess::flat_weights_);
    TORCH_INTERNAL_ASSERT(names.size() == weights.size());
    for (size_t i = 0; i < names.size(); ++i) visit(names[i], &weights[i]);
  }
};

template <typename M>
void members(const BindingSink& put, std::vector<std::pair<std::string, Tensor M::*>> list) {
  put(typeid(M), type_name_of<M>(), make_member_list_binder<M>(std::move(list)));
}

template <typename M>
void norm_members(const BindingSink& put) {
  members<M>(put, {{"weight", &M::weight},
                   {"bias", &M::bias},
                   {"running_mean", &M::running_mean},
                   {"running_var", &M::running_var},
                   {"num_batches_tracked", &M::num_batches_tracked}});
}

template <typename M>
void weight_bias(const BindingSink& put) {
  members<M>(put, {{"weight", &M::weight}, {"bias", &M::bias}});
}

template <typename M>
void rnn(const BindingSink& put) {
  put(typeid(M), type_name_of<M>(), make_typed_binder<M>(&RnnWeightsAccess<M>::visit));
}

template <typename M>
void rnn_cell(const BindingSink& put) {
  members<M>(put, {{"weight_ih", &M::weight_ih},
                   {"weight_hh", &M::weight_hh},
                   {"bias_ih", &M::bias_ih},
                   {"bias_hh", &M::bias_hh}});
}

// Losses that register options.weight() as a buffer. Some forward()s read a
// `weight` field, others options.weight() directly; both are bound.
template <typename M>
void loss_weight_member_and_option(const BindingSink& put) {
  put(typeid(M), type_name_of<M>(),
      make_typed_binder<M>([](M& m, const MemberHandleVisitor& visit) {
        visit("weight", &m.weight);
        visit("weight", &m.options.weight());
      }));
}

template <typename M>
void loss_weight_option(const BindingSink& put) {
  put(typeid(M), type_name_of<M>(),
      make_typed_binder<M>(
          [](M& m, const MemberHandleVisitor& visit) { visit("weight", &m.options.weight()); }));
}

template <typename M>
void registry_reading(const BindingSink& put) {
  put(typeid(M), type_name_of<M>(), nullptr);
}

}  // namespace

void register_stock_module_bindings(const BindingSink& put) {
  weight_bias<nn::LinearImpl>(put);
  weight_bias<nn::BilinearImpl>(put);
  weight_bias<nn::Conv1dImpl>(put);
  weight_bias<nn::Conv2dImpl>(put);
  weight_bias<nn::Conv3dImpl>(put);
  weight_bias<nn::ConvTranspose1dImpl>(put);
  weight_bias<nn::ConvTranspose2dImpl>(put);
  weight_bias<nn::ConvTranspose3dImpl>(put);
  weight_bias<nn::LayerNormImpl>(put);
  weight_bias<nn::GroupNormImpl>(put);

  norm_members<nn::BatchNorm1dImpl>(put);
  norm_members<nn::BatchNorm2dImpl>(put);
  norm_members<nn::BatchNorm3dImpl>(put);
  norm_members<nn::InstanceNorm1dImpl>(put);
  norm_members<nn::InstanceNorm2dImpl>(put);
  norm_members<nn::InstanceNorm3dImpl>(put);

  members<nn::EmbeddingImpl>(put, {{"weight", &nn::EmbeddingImpl::weight}});
  members<nn::EmbeddingBagImpl>(put, {{"weight", &nn::EmbeddingBagImpl::weight}});
  members<nn::PReLUImpl>(put, {{"weight", &nn::PReLUImpl::weight}});

  rnn<nn::RNNImpl>(put);
  rnn<nn::LSTMImpl>(put);
  rnn<nn::GRUImpl>(put);
  rnn_cell<nn::RNNCellImpl>(put);
  rnn_cell<nn::LSTMCellImpl>(put);
  rnn_cell<nn::GRUCellImpl>(put);

  // out_proj is a child Linear, reached by recursion.
  using MHA = nn::MultiheadAttentionImpl;
  members<MHA>(put, {{"in_proj_weight", &MHA::in_proj_weight},
                     {"in_proj_bias", &MHA::in_proj_bias},
                     {"bias_k", &MHA::bias_k},
                     {"bias_v", &MHA::bias_v},
                     {"q_proj_weight", &MHA::q_proj_weight},
                     {"k_proj_weight", &MHA::k_proj_weight},
                     {"v_proj_weight", &MHA::v_proj_weight}});

  loss_weight_member_and_option<nn::NLLLossImpl>(put);
  loss_weight_member_and_option<nn::CrossEntropyLossImpl>(put);
  put(typeid(nn::BCEWithLogitsLossImpl), type_name_of<nn::BCEWithLogitsLossImpl>(),
      make_typed_binder<nn::BCEWithLogitsLossImpl>(
          [](nn::BCEWithLogitsLossImpl& m, const MemberHandleVisitor& visit) {
            visit("weight", &m.weight);
            visit("weight", &m.options.weight());
            visit("pos_weight", &m.pos_weight);
            visit("pos_weight", &m.options.pos_weight());
          }));
  loss_weight_option<nn::BCELossImpl>(put);
  loss_weight_option<nn::MultiMarginLossImpl>(put);
  loss_weight_option<nn::MultiLabelSoftMarginLossImpl>(put);

  members<nn::FractionalMaxPool2dImpl>(
      put, {{"_random_samples", &nn::FractionalMaxPool2dImpl::_random_samples}});
  members<nn::FractionalMaxPool3dImpl>(
      put, {{"_random_samples", &nn::FractionalMaxPool3dImpl::_random_samples}});

  // ParameterList/ParameterDict are read through their registries.
  registry_reading<nn::ParameterListImpl>(put);
  registry_reading<nn::ParameterDictImpl>(put);
}

}  // namespace internal
}  // namespace functorch
