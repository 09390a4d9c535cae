-- Argo CD health check of ratelimit.sluice.dev/RateLimitPolicy, for the argocd-cm key
-- resource.customizations.health.ratelimit.sluice.dev_RateLimitPolicy (docs/operations.md: "Argo CD").
-- It reads the conditions the Sluice controller writes, as kstatus (and so Flux) does:
-- Stalled -> Degraded, Degraded -> Degraded, Ready -> Healthy, otherwise Progressing.
local hs = { status = "Progressing", message = "Waiting for the Sluice controller" }
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local generation = obj.metadata.generation
local conditions = {}
for _, c in ipairs(obj.status.conditions) do
  -- A condition about an older spec says nothing about this one.
  if generation == nil or c.observedGeneration == nil or c.observedGeneration >= generation then
    conditions[c.type] = c
  end
end
local function true_(t)
  return conditions[t] ~= nil and conditions[t].status == "True"
end
if true_("Stalled") then
  return { status = "Degraded", message = conditions["Stalled"].message }
end
if true_("Degraded") then
  return { status = "Degraded", message = conditions["Degraded"].message }
end
if true_("Ready") then
  return { status = "Healthy", message = conditions["Ready"].message }
end
if conditions["Reconciling"] ~= nil then
  hs.message = conditions["Reconciling"].message
end
return hs
