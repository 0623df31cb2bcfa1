// Validates the custom resources of a render (a JSON array, from
// `deploy_check.py json`) with the typed models the npm packages
// @kubernetes-models/keda and @kubernetes-models/cert-manager generate
// from the upstream CRDs: field types, required fields and enums. The
// strict schemas in deploy/schemas/ add "no unknown field" on top (the
// models allow unknown ones). Run by scripts/check-deploy.sh:
//
//   node scripts/validate_custom.mjs NODE_MODULES RENDER.json NAME
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const MODELS = {
  "keda.sh/v1alpha1 ScaledObject": "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject.js",
  "cert-manager.io/v1 Certificate": "@kubernetes-models/cert-manager/cert-manager.io/v1/Certificate.js",
};

const [modules, file, name] = process.argv.slice(2);
const docs = JSON.parse(readFileSync(file, "utf8"));
let failed = 0;
for (const doc of docs) {
  const model = MODELS[`${doc.apiVersion} ${doc.kind}`];
  if (!model) continue;
  const mod = await import(pathToFileURL(join(modules, model)).href);
  try {
    new mod[doc.kind](doc).validate();
  } catch (e) {
    console.error(`deploy: ${name}: ${doc.kind}/${doc.metadata.name}: ${e.message}`);
    failed = 1;
  }
}
process.exit(failed);
