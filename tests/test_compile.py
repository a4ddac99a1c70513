"""``trainer.compile`` (torch.compile of the model) traces the LM and the classifier on CPU: the compiled
loss and gradients equal eager ones. The backend is ``aot_eager`` (Dynamo capture + AOT autograd, the
part our code can break); Inductor's C++ code generation takes minutes on a 2-core CPU, so it is not run
here (checked by hand: the same losses, gradients within 2e-6, see bench/RESULTS.md)."""

import pytest
import test_model as tm
import torch
import torch.nn.functional as F

from mega_suite import MegalodonLM
from mega_suite.models.megalodon.model import MegalodonClassifier


def loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_compiled_loss_equals_eager(kind):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    if kind == "lm":
        model = tm.randomise(MegalodonLM(tm.tiny_config(chunk_size=8)), seed=0)
        tokens = torch.randint(0, 13, (2, 17), generator=gen)

        def loss_fn(m):
            logits, _ = m(tokens[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    else:
        model = tm.randomise(MegalodonClassifier(tm.tiny_config(chunk_size=8, num_classes=3)), seed=1)
        x, y = torch.randint(0, 13, (2, 16), generator=gen), torch.tensor([0, 2])

        def loss_fn(m):
            return F.cross_entropy(m(x), y)

    eager, eager_grads = loss_and_grads(model, loss_fn)
    compiled = torch.compile(model, backend="aot_eager")
    loss, grads = loss_and_grads(compiled, loss_fn)
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-6)
    for g, ge in zip(grads, eager_grads):
        torch.testing.assert_close(g, ge, rtol=1e-5, atol=1e-6)
