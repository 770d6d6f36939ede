#pragma once

// torch.func for LibTorch: vmap, grad, grad_and_value, vjp, jvp, jacrev,
// jacfwd, hessian on ATen's functorch engine (DynamicLayer stack,
// BatchedTensor, TensorWrapper, batching rules). Every transform maps a
// function to a function, so they compose: vmap(grad(f)), jacrev(jacrev(f)),
// vmap(jacrev(f)), hessian(f) = jacfwd(jacrev(f)).

#include "functorch/transforms/argnums.h"   // IWYU pragma: export
#include "functorch/transforms/grad.h"      // IWYU pragma: export
#include "functorch/transforms/has_aux.h"   // IWYU pragma: export
#include "functorch/transforms/jacobian.h"  // IWYU pragma: export
#include "functorch/transforms/jvp.h"       // IWYU pragma: export
#include "functorch/transforms/pytree.h"    // IWYU pragma: export
#include "functorch/transforms/tree_fn.h"   // IWYU pragma: export
#include "functorch/transforms/typed.h"     // IWYU pragma: export
#include "functorch/transforms/vjp.h"       // IWYU pragma: export
#include "functorch/transforms/vmap.h"      // IWYU pragma: export
