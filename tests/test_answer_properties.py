"""Property-based tests of the math reward (:mod:`arealite.reward.answer` through
:func:`arealite.reward.math.math_reward`), seeded (``derandomize``), 2,000 generated cases per class.

* Fooling classes: a completion whose final answer is a *different* expression built from the gold
  answer's digits — a fraction over it, a power of it, a mixed number whose fraction holds it, a
  unit's power, a list or tuple containing it, a list of equations ending in it, a hedge, a self-correction away from it, the gold negated,
  bounded or disowned (``\\neq g``, ``\\ge g``, "at least g", "g is incorrect") — scores 0.
* Equivalent rewritings of the gold (LaTeX fraction forms, decimals, mixed numbers, thousands
  separators, units and currency around the number, markers, inline in a sentence, a
  self-correction towards it) score 1.
"""

from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arealite.reward.answer import extract_final_answer
from arealite.reward.math import math_reward

CASES = settings(max_examples=2000, derandomize=True, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))

PREFIXES = ["", "Let me think step by step. ", "First, 3 + 4 = 7 and 12 / 4 = 3. ",
            "We have 25 apples and give away 10.\n", "Step 1: compute the total.\nStep 2: divide. "]
# Where the final answer goes: {a} is the answer expression (LaTeX allowed).
WRAPPERS = ["The answer is ${a}$.", "So the final answer is {a}.", "\\boxed{{{a}}}", "#### {a}",
            "Therefore $\\boxed{{{a}}}$", "so we get {a}", "**Answer:** {a}", "Final answer: ${a}$"]
# Wrappers with an answer marker: after an earlier \boxed{}, only a marker states a new answer (an
# unmarked number after a box is the explanation's, e.g. a check of the result).
MARKED = [w for w in WRAPPERS if "boxed" in w or "answer" in w or "####" in w]

gold_int = st.integers(min_value=1, max_value=99_999)
other_int = st.integers(min_value=1, max_value=999)
prefix = st.sampled_from(PREFIXES)
wrapper = st.sampled_from(WRAPPERS)


def completion(pre: str, wrap: str, expr: str) -> str:
    return pre + wrap.format(a=expr)


def assert_score(comp: str, gold: str, want: float):
    got = math_reward(comp, gold)
    assert got == want, f"math_reward({comp!r}, {gold!r}) = {got}, want {want}; extracted {extract_final_answer(comp)!r}"


# ------------------------------------------------------------------------- fooling classes: 0
@CASES
@given(g=gold_int, a=other_int, form=st.sampled_from(["\\frac{{{a}}}{{{g}}}", "\\dfrac{{{a}}}{{{g}}}", "{a}/{g}",
                                                      "\\tfrac{{{a}}}{{{g}}}", "-\\frac{{{a}}}{{{g}}}"]),
       pre=prefix, wrap=wrapper)
def test_a_fraction_over_the_gold_number_scores_0(g, a, form, pre, wrap):
    if Fraction(a, g) == g:
        return
    assert_score(completion(pre, wrap, form.format(a=a, g=g)), str(g), 0.0)


@CASES
@given(g=st.integers(min_value=2, max_value=60), b=st.integers(min_value=2, max_value=12),
       form=st.sampled_from(["{b}^{{{g}}}", "{g}^{{{b}}}", "{b}^{g}", "{g}^{b}"]), pre=prefix, wrap=wrapper)
def test_a_power_of_or_to_the_gold_number_scores_0(g, b, form, pre, wrap):
    assert_score(completion(pre, wrap, form.format(b=b, g=g)), str(g), 0.0)


@CASES
@given(g=st.integers(min_value=1, max_value=500), w=st.integers(min_value=1, max_value=500),
       extra=st.integers(min_value=1, max_value=500), which=st.booleans(),
       form=st.sampled_from(["{w}\\frac{{{n}}}{{{d}}}", "{w} \\frac{{{n}}}{{{d}}}", "{w} {n}/{d}"]),
       pre=prefix, wrap=wrapper)
def test_a_mixed_number_holding_the_gold_number_scores_0(g, w, extra, which, form, pre, wrap):
    n, d = (g, g + extra) if which else (extra, extra + g)  # the gold as numerator or denominator
    assert_score(completion(pre, wrap, form.format(w=w, n=n, d=d)), str(g), 0.0)
    if w != g:  # the whole part is not the answer either when the gold is the fraction's part
        assert_score(completion(pre, wrap, form.format(w=w, n=n, d=d)), str(w), 0.0)


@CASES
@given(g=st.integers(min_value=2, max_value=9), v=other_int,
       unit=st.sampled_from(["cm^{g}", "m^{g}", "\\text{{ cm}}^{g}", "\\text{{ m}}^{{{g}}}", "meters^{g}", "ft^{{{g}}}"]),
       pre=prefix, wrap=wrapper)
def test_a_units_power_is_not_the_answer(g, v, unit, pre, wrap):
    comp = completion(pre, wrap, f"{v} " + unit.format(g=g))
    if v != g:
        assert_score(comp, str(g), 0.0)
    assert_score(comp, str(v), 1.0)  # the number the unit qualifies is


@CASES
@given(g=gold_int, a=other_int, b=other_int,
       form=st.sampled_from(["{a}, {b}, {g}", "({a}, {g})", "[{g}, {a}]", "{a}, {g}", "\\{{{a}, {g}\\}}",
                             "({a}, {b}, {g})", "{a} \\\\ {g}", "{a} \\& {g}", "{a} & {g}"]),
       pre=prefix, wrap=wrapper)
def test_a_list_or_tuple_containing_the_gold_number_scores_0(g, a, b, form, pre, wrap):
    assert_score(completion(pre, wrap, form.format(a=a, b=b, g=g)), str(g), 0.0)


@CASES
@given(g=gold_int, a=other_int, var=st.sampled_from(["x", "y", "x_1", "n"]),
       sep=st.sampled_from([", ", "; ", " | ", " \\mid ", " \\vert ", " \\quad ", " \\qquad ", " \\\\ ", " \\; ",
                            " ~ ", ",\\quad ", ";; ", " || ", " \\mid\\mid ", " \\& ", " \\text{, } ", " \\text{ and } "]),
       order=st.booleans(), pre=prefix, wrap=wrapper)
def test_a_list_of_equations_holding_the_gold_number_scores_0(g, a, var, sep, order, pre, wrap):
    # "x = 3, x = 7" lists two solutions: it is no single one of them, whichever comes last.
    first, last = (a, g) if order else (g, a)
    listed = f"{var} = {first}{sep}{var} = {last}"
    if a == g:
        return
    assert_score(completion(pre, wrap, listed), str(g), 0.0)
    if "and" in sep:
        return  # "1 and 2" reads as a hedge, equal to no list either
    assert_score(completion(pre, "\\boxed{{{a}}}", listed), f"{first}, {last}", 1.0)
    assert_score(completion(pre, "\\boxed{{{a}}}", f"{first}, {last}"), listed, 1.0)


@CASES
@given(g=st.integers(min_value=2, max_value=999), k=st.integers(min_value=2, max_value=9), pre=prefix, wrap=wrapper,
       form=st.sampled_from(["x^2 = {sq}, x = {g}", "{k}x = {kg}, x = {g}", "{a} + {b} = {g}",
                             "{kg} / {k} = {g}", "x = {a} + {b} = {g}", "a = {k}, b = {g}"]))
def test_a_chain_of_working_ending_in_the_gold_scores_1(g, k, pre, wrap, form):
    # working steps parted by commas are no list of solutions: the last right-hand side answers
    expr = form.format(g=g, k=k, sq=g * g, kg=k * g, a=g - 1, b=1)
    assert_score(completion(pre, wrap, expr), str(g), 1.0)


@CASES
@given(g=gold_int, a=other_int, pre=prefix,
       form=st.sampled_from(["The answer is {a} or {g}.", "It is either {a} or {g}.", "\\boxed{{{a}}} or \\boxed{{{g}}}",
                             "The answer is between {a} and {g}.", "so {a} or {g}", "The answer is {g} or {a}.",
                             "$\\boxed{{{a}}}$ or $\\boxed{{{g}}}$", "the answer is {a} and {g}",
                             "\\boxed{{{a} \\lor {g}}}", "\\boxed{{{g} \\vee {a}}}", "\\boxed{{{a} | {g}}}",
                             "The answer is ${g} \\mid {a}$.", "\\boxed{{{g} \\text{{ (or {a})}}}}",
                             "The answer is {g} (or {a}).", "\\boxed{{{g}}} or {a}", "The answer is {g} (or maybe {a}).",
                             "\\boxed{{{g}}} (or perhaps {a})", "so perhaps {g} or {a}",
                             "\\boxed{{{a}}} (or \\boxed{{{g}}})", "\\boxed{{{a}}}\\boxed{{{g}}}", "\\boxed{{{a}}} / \\boxed{{{g}}}",
                             "\\boxed{{{a}}} \\text{{ or }} \\boxed{{{g}}}", "\\boxed{{{a} or \\boxed{{{g}}}}}",
                             "\\boxed{{{g}}} (maybe {a})", "\\boxed{{{g}}}, {a}.", "\\boxed{{{g}}} \\lor {a}",
                             "\\boxed{{{g}}} OR x = {a}", "\\boxed{{{a} ∨ {g}}}", "\\boxed{{{a}，{g}}}",
                             "\\boxed{{{g}}}, although it could be {a}", "\\boxed{{{g}}}. But it might also be {a}.",
                             "\\boxed{{{g}}}. Or maybe {a}.", "$\\boxed{{{g}}}$, though the answer may be ${a}$.",
                             "Answer: {a} or \\boxed{{{g}}}", "The answer is ${a}$, or maybe $\\boxed{{{g}}}$.",
                             "$\\boxed{{{g}}}$\n\nBut it might also be {a}.", "\\[\n\\boxed{{{g}}}\n\\]\nOr maybe {a}.",
                             "\\boxed{{{g}}}. (It may also be {a}.)", "\\boxed{{{a}}}. Or maybe \\boxed{{{g}}}.",
                             "\\boxed{{x_1 = {a}, x_2 = {g}}}", "\\boxed{{x_{{1}} = {g} \\quad x_{{2}} = {a}}}"]))
def test_a_hedge_between_two_values_scores_0(g, a, pre, form):
    if a == g:
        return
    assert_score(pre + form.format(a=a, g=g), str(g), 0.0)


@CASES
@given(g=st.integers(min_value=2, max_value=99_999), a=other_int, pre=prefix, wrap=wrapper,
       form=st.sampled_from(["{a} \\cup {g}", "\\cancel{{{a}}} {g}", "{a} \\parallel {g}", "{a} \\to {g}",
                             "\\color{{red}}{{{a}}} {g}", "{g}²", "{a} \\cap {g}"]))
def test_operators_and_unicode_that_hide_a_second_value_score_0(g, a, pre, wrap, form):
    # against a plain number, only numbers and frac/sqrt/pi expressions count; 7² is a power
    assert_score(completion(pre, wrap, form.format(a=a, g=g)), str(g), 0.0)


@CASES
@given(g=st.integers(min_value=2, max_value=999), k=st.integers(min_value=2, max_value=9), pre=prefix,
       form=st.sampled_from(["which equals ${k} \\cdot {q}$, or $\\boxed{{{g}}}$.", "\\boxed{{{g}}} (or {g60} minutes)",
                             "$\\frac{{{kg}}}{{{k}}}$, or $\\boxed{{{g}}}$", "\\boxed{{{g}}}, although it could be {g}.0",
                             "${g}$ hours, or $\\boxed{{{g60}}}$ minutes", "\\boxed{{{g}}}. Each of the {k} boxes could be full.",
                             "\\boxed{{x_1 = {g}, x_2 = {g}}}", "\\boxed{{x_1 = {k}, y_1 = {g}}}",
                             "The area is half of ${kg}$, or $\\boxed{{{g}}}$.", "$7 - {k}$, or $\\boxed{{{g}}}$",
                             "Only $\\boxed{{{g}}}$ leaves a remainder of 1 when divided by 2, 3, or {k}.",
                             "So she needs {k} times {q} or \\boxed{{{g}}}.", "$\\boxed{{{g}}}$. If order mattered, the answer could be {kg}.",
                             "\\boxed{{a_1 = {k}, a_{{20}} = {g}}}", "\\boxed{{d_1 = {k}, d_2 = {k}, d = {g}}}"]))
def test_a_restatement_beside_the_box_is_no_hedge(g, k, pre, form):
    # MATH's "or" often means "that is": the same value again, or the value in another unit
    expr = form.format(g=g, k=k, q=Fraction(g, k), kg=k * g, g60=60 * g)
    gold = str(60 * g) if "hours" in form else str(g)
    assert_score(pre + expr, gold, 1.0)


@CASES
@given(g=gold_int, a=other_int, pre=prefix,
       form=st.sampled_from(["\\boxed{{{g}}}. Wait, that's wrong. Let me redo it. \\boxed{{{a}}}",
                             "The answer is {g}. Hmm, no: the answer is {a}.",
                             "#### {g}\nActually I made an error.\n#### {a}",
                             "I first got \\boxed{{{g}}}, but recounting gives \\boxed{{{a}}}"]))
def test_a_self_correction_away_from_the_gold_scores_0(g, a, pre, form):
    if a == g:
        return
    assert_score(pre + form.format(a=a, g=g), str(g), 0.0)


@CASES
@given(g=st.integers(min_value=20, max_value=999), a=st.integers(min_value=1, max_value=19), pre=prefix,
       op=st.sampled_from(["+", "-", "\\times", "\\cdot", "*"]), wrap=wrapper)
def test_an_unevaluated_calculation_is_not_a_number(g, a, op, pre, wrap):
    b = {"+": g - a, "-": g + a}.get(op)
    if b is None:
        if g % a:
            return
        b = g // a
    assert_score(completion(pre, wrap, f"{a} {op} {b}"), str(g), 0.0)
    assert_score(completion(pre, wrap, f"{a} {op} {b} = {g}"), str(g), 1.0)



@CASES
@given(g=gold_int, pre=prefix, wrap=wrapper,
       form=st.sampled_from(["\\neq {g}", "\\ne {g}", "\\not= {g}", "x \\neq {g}", "x != {g}", "\\neg {g}",
                             "\\le {g}", "\\geq {g}", "< {g}", "> {g}", "\\text{{not }} {g}", "\\text{{at least }} {g}",
                             "\\text{{at most }} {g}", "\\text{{more than }} {g}", "\\text{{fewer than }} {g}",
                             "{g} \\text{{ or more}}", "{g} \\text{{ or less}}", "\\text{{almost }} {g}",
                             "\\text{{nearly }} {g}", "{g} \\text{{ (wrong)}}", "{g} \\text{{ is incorrect}}"]))
def test_a_negated_bounded_or_disowned_gold_number_scores_0(g, pre, wrap, form):
    assert_score(completion(pre, wrap, form.format(g=g)), str(g), 0.0)


# ------------------------------------------------------------------------- equivalent forms: 1
@CASES
@given(g=gold_int, k=st.integers(min_value=2, max_value=9), a=other_int, pre=prefix, wrap=wrapper,
       form=st.sampled_from(["{g}", "{g}.0", "{g}.00", "{gc}", "\\frac{{{kg}}}{{{k}}}", "\\dfrac{{{g}}}{{1}}",
                             "{g} \\text{{ cm}}^2", "\\${gc}", "{g} dollars", "x = {g}", "{g}\\%", "{g} percent",
                             "{g}^{{\\circ}}", "{g} apples"]))
def test_equivalent_forms_of_an_integer_score_1(g, k, a, pre, wrap, form):
    expr = form.format(g=g, gc=f"{g:,}", kg=k * g, k=k)
    assert_score(completion(pre, wrap, expr), str(g), 1.0)
    # A self-correction towards the gold: the last answer counts.
    if a != g and wrap in MARKED:
        assert_score(pre + f"\\boxed{{{a}}}. Wait, that's wrong. " + wrap.format(a=expr), str(g), 1.0)


@CASES
@given(p=st.integers(min_value=1, max_value=400), q=st.integers(min_value=2, max_value=60),
       k=st.integers(min_value=2, max_value=7), pre=prefix, wrap=wrapper,
       gold_form=st.sampled_from(["\\frac{{{p}}}{{{q}}}", "{p}/{q}", "\\dfrac{{{p}}}{{{q}}}"]),
       form=st.sampled_from(["\\frac{{{p}}}{{{q}}}", "\\dfrac{{{p}}}{{{q}}}", "\\tfrac{{{p}}}{{{q}}}", "{p}/{q}",
                             "\\frac{{{kp}}}{{{kq}}}", "{dec}", "{mixed}", "{mixed_slash}", "{short}"]))
def test_equivalent_forms_of_a_fraction_score_1(p, q, k, pre, wrap, gold_form, form):
    v = Fraction(p, q)
    if v.denominator == 1:
        return
    p, q = v.numerator, v.denominator
    dec = None
    if all(f in (2, 5) for f in _factors(q)):
        dec = str(float(v)) if len(str(float(v))) < 15 else None
    w, r = divmod(p, q)
    options = {"dec": dec,
               "mixed": f"{w}\\frac{{{r}}}{{{q}}}" if w else None,
               "mixed_slash": f"{w} {r}/{q}" if w else None,
               "short": f"\\frac{p}{q}" if p < 10 and q < 10 else None}
    key = form.strip("{}")
    if key in options and options[key] is None:
        return
    expr = form.format(p=p, q=q, kp=k * p, kq=k * q, **{kk: vv for kk, vv in options.items() if vv})
    assert_score(completion(pre, wrap, expr), gold_form.format(p=p, q=q), 1.0)
    # Inline in a sentence, no marker.
    assert_score(pre + f"So she ate ${expr}$ of the pie in total.", gold_form.format(p=p, q=q), 1.0)


@CASES
@given(a=st.integers(min_value=-50, max_value=50), b=st.integers(min_value=-50, max_value=50), pre=prefix,
       wrap=st.sampled_from(["\\boxed{{{a}}}", "The answer is ${a}$.", "So the point is {a}."]),
       form=st.sampled_from(["({a}, {b})", "({a},{b})", "\\left( {a}, {b} \\right)"]))
def test_tuples_match_in_order_only(a, b, pre, wrap, form):
    gold = f"({a}, {b})"
    assert_score(completion(pre, wrap, form.format(a=a, b=b)), gold, 1.0)
    if a != b:
        assert_score(completion(pre, wrap, form.format(a=b, b=a)), gold, 0.0)


def _factors(n: int) -> list[int]:
    out, f = [], 2
    while f * f <= n:
        while n % f == 0:
            out.append(f)
            n //= f
        f += 1
    return out + ([n] if n > 1 else [])
