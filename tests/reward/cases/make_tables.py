"""Writes the grader case tables (k12.jsonl, format.jsonl, vision.jsonl) beside this file.

Every expected score below was decided by hand, as a fair human grader would, before any grader
ran on it; `tests/reward/test_case_tables.py` holds the graders to them. Long hostile inputs are
stored as {"repeat", "times", "prefix", "suffix"} to keep the tables small.

    python tests/reward/cases/make_tables.py
"""
import json
from pathlib import Path

HERE = Path(__file__).parent
def R(unit, times, prefix="", suffix=""):
    return {"repeat": unit, "times": times, "prefix": prefix, "suffix": suffix}
# k12: (response, truth, expected)
CHOICE = [
    ("B", "B", 1), ("b", "B", 1), ("(B)", "B", 1), ("B.", "B", 1), ("B)", "B", 1), ("B:", "B", 1),
    ("B,", "B", 1), ("A,", "A", 1), ("**B**", "B", 1), ("**(C)**", "C", 1), ("[D]", "D", 1),
    ("The answer is B", "B", 1), ("The answer is B.", "B", 1),
    ("the correct answer is (C)", "C", 1),
    ("Answer: D", "D", 1), ("Option B", "B", 1), ("Final answer: E", "E", 1),
    ("答案是C", "C", 1), ("选B", "B", 1), ("Ｂ", "B", 1), ("（B）", "B", 1),
    ("I think the answer is B", "B", 1), ("I think it's B", "B", 1), ("I would pick C.", "C", 1),
    ("I", "I", 1), ("(I)", "I", 1), ("A", "A", 1), ("A is correct", "A", 1),
    ("A triangle has three sides, so C", "C", 1), ("A triangle has three sides, so C", "A", 0),
    ("I think so too, D", "D", 1), ("I think so too, D", "I", 0),
    ("B. Because A is wrong", "B", 1), ("B, since C cannot hold", "B", 1),
    ("(B) or (C)", "B", 0), ("(B) or (C)", "C", 0), ("B or C", "B", 0), ("A, B, C, D", "A", 0),
    ("A, B, C, D", "D", 0), ("A/B", "A", 0), ("B and C", "B", 0), ("between A and B", "B", 0),
    ("B", "C", 0), ("(A)", "B", 0), ("none of them", "B", 0), ("", "B", 0), ("42", "B", 0),
    ("\\boxed{B}", "B", 1), ("\\boxed{(B)}", "B", 1), ("\\boxed{B} or \\boxed{C}", "C", 0),
    ("So the answer is $\\text{B}$", "B", 1), ("It must be D.", "D", 1), ("It must be D.", "I", 0),
    ("A bird in the hand; answer: B", "B", 1), ("All of the above", "A", 0),
]
NUMBER = [
    ("12", "12", 1), ("12.0", "12", 1), ("12.00", "12", 1), ("+12", "12", 1), ("-3", "-3", 1),
    ("−3", "-3", 1), ("3", "-3", 0), ("1,200", "1200", 1), ("1200", "1,200", 1),
    ("1,200.5", "1200.5", 1),
    ("0.75", "3/4", 1), ("3/4", "0.75", 1), ("\\frac{3}{4}", "0.75", 1),
    ("\\dfrac{3}{4}", "3/4", 1),
    ("\\boxed{\\frac{3}{4}}", "3/4", 1), ("$\\frac{1}{2}$", "0.5", 1), ("\\frac12", "0.5", 1),
    ("-\\frac{2}{3}", "-2/3", 1), ("\\frac{-2}{3}", "-2/3", 1), ("x = -2/3", "-2/3", 1),
    ("\\frac{3}{4}", "4", 0), ("\\boxed{\\frac{3}{4}}", "4", 0), ("$\\frac{1}{2}$", "2", 0),
    ("Answer: 3 + 4 = 7", "7", 1), ("Answer: 3 + 4 = 7", "3", 0), ("2 \\times 6 = 12", "12", 1),
    ("so the total is 1,200.", "1200", 1), ("There are 24 students.", "24", 1),
    ("12 cm", "12 cm", 1), ("12cm", "12 cm", 1), ("12 centimeters", "12 cm", 1),
    ("12 m", "12 cm", 0),
    ("12 cm (6 cm + 6 cm)", "12 cm", 1), ("12 cm (6 cm + 6 cm)", "6 cm", 0),
    ("12", "12 cm", 1), ("12 \\text{ cm}", "12 cm", 1), ("12\\,\\mathrm{cm}", "12 cm", 1),
    ("12 cm^2", "12 cm^2", 1), ("12 cm²", "12 cm^2", 1), ("12 square cm", "12 cm^2", 1),
    ("12 cm", "12 cm^2", 0), ("90°", "90 degrees", 1), ("90^\\circ", "90", 1),
    ("90 degrees", "90°", 1),
    ("45%", "45%", 1), ("45 \\%", "45%", 1), ("45 percent", "45%", 1), ("45%", "45", 1),
    ("3.14", "3.14159", 0), ("1.2 \\times 10^{3}", "1200", 1), ("1.2e3", "1200", 1),
    ("１２", "12", 1), ("١٢", "12", 1), ("१२", "12", 1), ("12.", "12", 1),
    ("4 apples and 3 pears", "3", 1), ("seven", "7", 0), ("", "7", 0), ("7", "7.0000001", 1),
    ("7.01", "7", 0), ("1/0", "1", 0), ("0.3333", "1/3", 0), ("0.3333333333", "1/3", 1),
    # at the default relative tolerance (1e-6) a rounding at the 6th digit is the same number
    ("0.333333", "1/3", 1),
    ("3, 4, 5", "5", 0), ("3 or 4", "4", 0), ("3, 4, and 5", "3", 0), ("4 and 4", "4", 1),
    ("\\boxed{3} \\boxed{4}", "4", 0), ("\\boxed{4}, so again \\boxed{4}", "4", 1),
    ("The answer is 5 km/h", "5 km/h", 1), ("5 km/h", "5 m/s", 0), ("100 kg", "100 kilograms", 1),
]
SHORT = [
    ("Paris", "Paris", 1), ("paris", "Paris", 1), ("Paris.", "Paris", 1), ("The Paris", "Paris", 1),
    ("London", "Paris", 0), ("photosynthesis", "Photosynthesis", 1), ("Ｐａｒｉｓ", "Paris", 1),
    ("  Paris  ", "Paris", 1), ("Paris, France", "Paris", 0),
    ("mitochondria", "the mitochondria", 1),
]
WRAPS = [  # each keeps the stated answer; the expected score does not change
    ("{}", "plain"), ("The answer is {}", "sentence"), ("\\boxed{{{}}}", "boxed"),
    ("<answer>{}</answer>", "tag"), ("Let me think.\nStep 1 ...\nFinal answer: {}", "worked"),
]
rows = []
for kind, table in (("choice", CHOICE), ("number", NUMBER), ("short", SHORT)):
    for response, truth, want in table:
        if not response:
            rows.append({"response": response, "truth": truth, "score": want, "kind": kind,
                         "wrap": "plain"})
            continue
        for template, wrap in WRAPS:
            if wrap != "plain" and ("\\boxed" in response or "answer" in response.lower()
                                    or "\n" in response):
                continue  # already states where its answer is
            if wrap == "boxed" and kind == "short":
                continue
            if (wrap == "sentence" and kind != "number" and response[:1] in "IA"
                    and len(response) > 2):
                continue  # "The answer is I think..." reads differently
            rows.append({"response": template.format(response), "truth": truth, "score": want,
                         "kind": kind, "wrap": wrap})
# hostile and odd inputs: all 0 with a truth the text does not state
HOSTILE = [R("\\boxed{", 20000), R(" ", 100000, "", "1"), R(" ", 100000, "1"), R("<answer>", 20000),
           R("answer ", 20000), R("((((((((((", 5000), R("9", 5000), R("\\frac{", 10000),
           R("=", 50000),
           R("A, ", 10000), "\u0000\u202e B", R("x", 300000), "1e999999", R("-", 100000, "", "5")]
for h in HOSTILE:
    rows.append({"response": h, "truth": "7", "score": 0, "kind": "hostile", "wrap": "plain"})
rows.append({"response": R("\\boxed{", 20000, "", "7}"), "truth": "7", "score": 1,
             "kind": "hostile", "wrap": "plain"})
with open(HERE / "k12.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
print("k12", len(rows))

FORMAT = [
    ("<think>a</think><answer>b</answer>", "think_answer", 1),
    ("<think>a</think>\n<answer>b</answer>", "think_answer", 1),
    ("  <think>a</think> <answer>b</answer>  ", "think_answer", 1),
    (R("x", 300000, "<think>", "</think><answer>b</answer>"), "think_answer", 1),
    ("<think></think><answer>b</answer>", "think_answer", 0),
    ("<think>a</think><answer></answer>", "think_answer", 0),
    ("<think>a</think><answer> </answer>", "think_answer", 0),
    ("<answer>b</answer>", "think_answer", 0), ("<think>a</think>", "think_answer", 0),
    ("<answer>b</answer><think>a</think>", "think_answer", 0),
    ("hi <think>a</think><answer>b</answer>", "think_answer", 0),
    ("<think>a</think><answer>b</answer> bye", "think_answer", 0),
    ("<think>a</think>text<answer>b</answer>", "think_answer", 0),
    ("<think>a</think><answer>b</answer><answer>c</answer>", "think_answer", 0),
    ("<think>a<think>b</think><answer>c</answer>", "think_answer", 0),
    (R("<think>", 20000), "think_answer", 0), (R("</think>", 20000), "think_answer", 0),
    ("", "think_answer", 0), ("just an answer", "think_answer", 0),
    ("\\boxed{1}", "boxed", 1), ("so \\boxed{x+1}", "boxed", 1), ("\\boxed{}", "boxed", 0),
    ("\\boxed{ }", "boxed", 0), ("\\boxed{", "boxed", 0), (R("\\boxed{", 20000), "boxed", 0),
    ("\\fbox{2}", "boxed", 1), ("\\boxed{1} \\boxed{2}", "boxed", 0),
    ("\\boxed{2} hence \\boxed{2}", "boxed", 1), ("\\boxed {3}", "boxed", 1),
    ("boxed{3}", "boxed", 0),
    ("\\boxed{\\frac{1}{2}}", "boxed", 1), ("\\boxed{{}}", "boxed", 1), ("no box", "boxed", 0),
    (R("x", 300000, "", "\\boxed{1}"), "boxed", 1),
    ("<answer>b</answer>", "answer", 1), ("text <answer>b</answer>", "answer", 1),
    ("<answer></answer>", "answer", 0), ("<answer>a</answer><answer>b</answer>", "answer", 0),
    ("<answer>a", "answer", 0), (R("<answer>", 20000), "answer", 0),
    ("</answer><answer>", "answer", 0),
    ("A, B, C, D", "answer", 0),
]
rows = [{"response": r, "args": {"pattern": p}, "score": s} for r, p, s in FORMAT]
with open(HERE / "format.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
print("format", len(rows))

VISION = [
    ("4", {"count": 4}, 1), ("There are 4 cats.", {"count": 4}, 1), ("4.5", {"count": 4}, 0),
    ("4.5", {"count": 5}, 0), ("1,000", {"count": 1000}, 1), ("1,000", {"count": 0}, 0),
    ("1000", {"count": 1000}, 1), ("4.0", {"count": 4}, 1), ("\\boxed{7}", {"count": 7}, 1),
    ("3 dogs and 4 cats, so 7", {"count": 7}, 1), ("seven", {"count": 7}, 0), ("", {"count": 0}, 0),
    ("０", {"count": 0}, 1), ("3, 4, 5", {"count": 5}, 0), ("4 or 5", {"count": 5}, 0),
    ("-3", {"count": 3}, 0), ("1 000 000" , {"count": 1000000}, 0),
    ("[0, 0, 10, 10]", {"box": [0, 0, 10, 10]}, 1), ("(0,0),(10,10)", {"box": [0, 0, 10, 10]}, 1),
    ("<box>(0,0),(10,10)</box>", {"box": [0, 0, 10, 10]}, 1),
    ('{"bbox_2d": [0, 0, 10, 10]}', {"box": [0, 0, 10, 10]}, 1),
    ("[10, 10, 0, 0]", {"box": [0, 0, 10, 10]}, 0), ("none", {"box": [0, 0, 10, 10]}, 0),
    ("[20, 20, 30, 30]", {"box": [0, 0, 10, 10]}, 0),
    ("[0, 0, 10, 20]", {"box": [0, 0, 10, 10]}, 0.5),
    (R(" ", 100000, "[", "0, 0, 10, 10]"), {"box": [0, 0, 10, 10]}, 1),
    (R("(", 50000), {"box": [0, 0, 10, 10]}, 0),
    ("no objects", {"boxes": []}, 1), ("[]", {"boxes": []}, 1), ("[0, 0, 5, 5]", {"boxes": []}, 0),
    ("[0, 0, 10, 10] [20, 20, 30, 30]", {"boxes": [[0, 0, 10, 10], [20, 20, 30, 30]]}, 1),
    ("[0, 0, 10, 10]", {"boxes": [[0, 0, 10, 10], [20, 20, 30, 30]]}, 0.5),
    ("[0, 0, 10, 10] [0, 0, 10, 10]", {"boxes": [[0, 0, 10, 10]]}, 0.5),
    ("(5, 5)", {"point_in": [0, 0, 10, 10]}, 1), ("[5, 5]", {"point_in": [0, 0, 10, 10]}, 1),
    ("(50, 5)", {"point_in": [0, 0, 10, 10]}, 0), ("nowhere", {"point_in": [0, 0, 10, 10]}, 0),
]
rows = [{"response": r, "truth": t, "score": s} for r, t, s in VISION]
with open(HERE / "vision.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
print("vision", len(rows))
