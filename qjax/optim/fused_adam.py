"""placeholder"""
from qjax.optim import adam


def adam_update(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt):
    return adam.update_reference(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt)
